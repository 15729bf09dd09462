"""What the benchmark scripts share: running `tianji train` as a fresh command and reading its summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_tianji(preset: str, run_dir: Path, seed: int, overrides: list[str], launcher: str = "local") -> dict:
    """One training command (its own process, timed from its own start); returns summary.json."""
    command = [
        sys.executable,
        "-m",
        "tianji",
        "train",
        preset,
        "--run-dir",
        str(run_dir),
        "--launcher",
        launcher,
        "--set",
        f"seed={seed}",
        "--set",
        "logging.console=false",
    ]
    for item in overrides:
        command += ["--set", item]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())
