"""What the benchmark scripts share: running `tianji train` as a fresh command and reading its summary
and metrics."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def train_command(preset: str, run_dir: Path, *settings: str, launcher: str | None = None) -> list[str]:
    """`tianji train PRESET --run-dir RUN_DIR [--launcher L] --set S ...` in this interpreter, console off."""
    command = [sys.executable, "-m", "tianji", "train", preset, "--run-dir", str(run_dir)]
    if launcher is not None:
        command += ["--launcher", launcher]
    for item in ("logging.console=false", *settings):
        command += ["--set", item]
    return command


def run_tianji(preset: str, run_dir: Path, seed: int, overrides: list[str], launcher: str = "local") -> dict:
    """One training command (its own process, timed from its own start); returns summary.json."""
    command = train_command(preset, run_dir, f"seed={seed}", *overrides, launcher=launcher)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def metric_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, a dict per logged row (the last one written after the stop)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def value_at(rows: list[dict], key: str, seconds: float) -> float | None:
    """The last finite `key` logged at or before `seconds` into the run (None before the first)."""
    values = [r[key] for r in rows if r["time_s"] <= seconds and r.get(key) is not None and r[key] == r[key]]
    return values[-1] if values else None


def curve(rows: list[dict], key: str, every: int = 6) -> list[tuple[float, float]]:
    """(minutes, value) of every `every`-th row that logged a finite `key`: a figure's line, small enough for JSON."""
    return [(round(r["time_s"] / 60, 2), r[key]) for r in rows[::every] if r.get(key) is not None and r[key] == r[key]]


def update_page_tables(marker: str, table: str) -> None:
    """Replace what stands between `<!-- MARKER -->` and `<!-- /MARKER -->` in the README and the benchmarks
    page (a page without the markers is left alone)."""
    root = Path(__file__).parents[1]
    for page in (root / "README.md", root / "docs" / "benchmarks.md"):
        text = page.read_text()
        if f"<!-- {marker} -->" in text:
            head, rest = text.split(f"<!-- {marker} -->", 1)
            _, tail = rest.split(f"<!-- /{marker} -->", 1)
            page.write_text(f"{head}<!-- {marker} -->\n{table}<!-- /{marker} -->{tail}")


def machine() -> str:
    """'2 cores, <CPU model>': the machine a result was measured on."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    return f"{len(os.sched_getaffinity(0))} cores, {model}"
