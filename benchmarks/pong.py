"""Pong from pixels for an hour: the learning curve (game score against wall time and env steps),
training on until a 100-episode mean of 18 or the time limit, whatever the preset's own target.

    python benchmarks/pong.py [--preset pong-ppo] [--minutes 60] [--run-dir runs/pong-60min]

Trains the preset as one `tianji train` command, then prints the 100-episode mean game score every
10 minutes, when it first reached 0, and saves the curve (needs matplotlib) as
benchmarks/results/<preset>-curve.png. `tianji eval RUN_DIR --video pong.mp4` replays the result.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
from pathlib import Path

from common import train_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-ppo")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--run-dir", default="runs/pong-60min")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    command = train_command(
        args.preset,
        run_dir,
        f"stop.max_wall_time_s={args.minutes * 60}",
        "stop.target_return=18",
        "logging.interval_s=10",
        *args.overrides,
    )
    subprocess.run(command, check=True)
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    score = [
        (float(r["time_s"]), int(float(r["env_steps"])), float(r["env/return_mean100"]))
        for r in rows
        if r["env/return_mean100"] not in ("", "nan")
    ]
    print(f"{args.preset}: 100-episode mean game score")
    for minute in range(10, int(args.minutes) + 1, 10):
        seen = [s for s in score if s[0] <= minute * 60]
        if seen:
            t, steps, value = seen[-1]
            print(f"  {minute:>3} min  {steps:>10,} env steps  score {value:6.1f}")
    zero = next((s for s in score if s[2] >= 0), None)
    print("  reached 0: " + (f"after {zero[0] / 60:.1f} min, {zero[1]:,} env steps" if zero else "no"))
    print(f"  best: {max(s[2] for s in score):.1f}" if score else "  no finished episodes")
    curve = subprocess.run([sys.executable, "-m", "tianji", "plot", str(run_dir)], capture_output=True, text=True)
    if curve.returncode == 0:
        out = Path(__file__).parent / "results" / f"{args.preset}-curve.png"
        shutil.copy(run_dir / "curve.png", out)
        print(f"  curve: {out}")
    else:
        print(f"  no curve: {curve.stderr.strip()}")


if __name__ == "__main__":
    main()
