"""What the benchmark scripts share: running `tianji train` as a fresh command and reading its summary
and metrics."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
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


STEADY_KEYS = ("perf/actor_busy", "perf/learner_busy", "balance/lag_mean")


def steady_rate(preset: str, overrides: list[str], seconds: float, warmup_s: float = 20.0) -> tuple[float, dict]:
    """One `tianji train PRESET` command run for `warmup_s + seconds` (no target): its env steps/s over the
    last `seconds` (start-up excluded), and the means of STEADY_KEYS over them."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        settings = ["stop.target_return=null", f"stop.max_wall_time_s={seconds + warmup_s}", "logging.interval_s=1"]
        command = train_command(preset, run_dir, *settings, *overrides)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = metric_rows(run_dir)
    rows = rows[:-1]  # the last row is written after the stop
    steady = [r for r in rows if r["time_s"] >= rows[-1]["time_s"] - seconds]
    rate = (steady[-1]["env_steps"] - steady[0]["env_steps"]) / (steady[-1]["time_s"] - steady[0]["time_s"])
    means = {key: statistics.fmean(r[key] for r in steady[1:] if _finite(r.get(key))) for key in STEADY_KEYS}
    return rate, means


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def finished(run_dir: Path) -> bool:
    """Whether the run directory holds a run that ended by its own stop (target or cap). A run stopped from
    outside (Ctrl-C, SIGTERM: a sitting cut short) writes its summary too, with stop_reason "interrupted":
    it is made again, not read as a miss."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("stop_reason") != "interrupted"
    except (OSError, ValueError):
        return False


def metric_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, a dict per logged row (the last one written after the stop)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def value_at(rows: list[dict], key: str, seconds: float, slack_s: float = 15.0) -> float | None:
    """The last finite `key` logged at or before `seconds` into the run; None before the first, and None when
    the run ended before `seconds` (less `slack_s`: a run capped there logs its last row about then)."""
    if not rows or rows[-1]["time_s"] < seconds - slack_s:
        return None
    values = [r[key] for r in rows if r["time_s"] <= seconds and r.get(key) is not None and r[key] == r[key]]
    return values[-1] if values else None


def summary_of(run_dir: Path) -> dict:
    """The run's summary.json, or {} for a run that never wrote one (killed, or still going)."""
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def curve(rows: list[dict], key: str, every: int = 6) -> list[tuple[float, float]]:
    """(minutes, value) of every `every`-th row that logged a finite `key`: a figure's line, small enough for JSON."""
    return [(round(r["time_s"] / 60, 2), r[key]) for r in rows[::every] if r.get(key) is not None and r[key] == r[key]]


def steps_and_rate(runs: list[dict]) -> str:
    """Two table cells: the runs' median env steps (millions) and median env steps/s."""
    steps = statistics.median(r["env_steps"] for r in runs)
    return f"{steps / 1e6:.2f}M | {statistics.median(r['env_steps_per_s'] for r in runs):,.0f}"


def machines_of(runs: list[dict]) -> str:
    return "; ".join(sorted({r["machine"] for r in runs}))


class Sittings:
    """A benchmark's runs gathered over several sittings (an hour a run): one row per (name, seed) in OUT.json,
    earlier rows kept unless `replace`, and the table of them all in OUT.md."""

    def __init__(self, out: Path, name_key: str, replace: bool = False):
        self.out, self.name_key = out, name_key
        earlier = out.with_suffix(".json")
        rows = [] if replace or not earlier.exists() else json.loads(earlier.read_text())
        self.rows = {(row[name_key], row["seed"]): row for row in rows}

    def add(self, row: dict) -> None:
        self.rows[(row[self.name_key], row["seed"])] = row

    def ordered(self) -> list[dict]:
        return [self.rows[key] for key in sorted(self.rows)]

    def save(self, markdown: Callable[[list[dict]], str]) -> str:
        """Write OUT.json and OUT.md; returns the table."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".json").write_text(json.dumps(self.ordered(), indent=1) + "\n")
        table = markdown(self.ordered())
        self.out.with_suffix(".md").write_text(table)
        return table


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
