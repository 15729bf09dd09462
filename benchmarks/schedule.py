"""What a run that repeats costs: env steps/s of `balance.schedule: deterministic` against the free
asynchronous schedule, side by side on the same cores.

    python benchmarks/schedule.py [--presets pong-appo cartpole-ppo] [--pairs 3] [--seconds 60 15]

Each pair runs the preset free, then deterministic, one command at a time (A B A B ...); a run's rate is
its env steps/s over its last SECONDS (start-up excluded), with the actors' and the learner's busy
shares and the mean policy lag over the same window. Per preset: every pair's ratio deterministic / free
and their median. Results: benchmarks/results/schedule.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import machine, steady_rate

RESULTS = Path(__file__).parent / "results"
SCHEDULES = ("free", "deterministic")


def measure(preset: str, pairs: int, seconds: float, overrides: list[str]) -> list[dict]:
    """`pairs` pairs of runs, free then deterministic: one row per run."""
    rows = []
    for pair in range(pairs):
        for schedule in SCHEDULES:
            rate, means = steady_rate(preset, [f"balance.schedule={schedule}", *overrides], seconds)
            rows.append({"preset": preset, "pair": pair, "schedule": schedule, "env_steps_per_s": rate, **means})
            print(
                f"{preset} pair {pair} {schedule:>13}: {rate:8,.0f} env steps/s (actors busy "
                f"{means['perf/actor_busy']:.0%}, learner busy {means['perf/learner_busy']:.0%}, "
                f"lag {means['balance/lag_mean']:.1f})",
                flush=True,
            )
    return rows


def ratios(rows: list[dict], preset: str) -> list[float]:
    """deterministic / free, pair by pair."""
    rate = {(r["pair"], r["schedule"]): r["env_steps_per_s"] for r in rows if r["preset"] == preset}
    pairs = sorted({pair for pair, _ in rate})
    return [rate[pair, "deterministic"] / rate[pair, "free"] for pair in pairs]


def markdown(rows: list[dict], presets: list[str], seconds: dict[str, float]) -> str:
    lines = [
        "| preset | schedule | env steps/s (median; each pair) | actors busy | learner busy | lag mean |"
        " deterministic / free (median; each pair) |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset in presets:
        share = ratios(rows, preset)
        for schedule in SCHEDULES:
            mine = [r for r in rows if r["preset"] == preset and r["schedule"] == schedule]
            rates = [r["env_steps_per_s"] for r in mine]

            def median(key: str, runs: list[dict] = mine) -> float:
                return statistics.median(r[key] for r in runs)

            ratio = (
                f"{statistics.median(share):.2f} ({', '.join(f'{x:.2f}' for x in share)})"
                if schedule == "deterministic"
                else ""
            )
            lines.append(
                f"| {preset} | {schedule} | {statistics.median(rates):,.0f} ({', '.join(f'{x:,.0f}' for x in rates)})"
                f" | {median('perf/actor_busy'):.0%} | {median('perf/learner_busy'):.0%}"
                f" | {median('balance/lag_mean'):.1f} | {ratio} |"
            )
    windows = ", ".join(f"{preset} {seconds[preset]:.0f} s" for preset in presets)
    lines += [
        "",
        f"Steady env steps/s over each run's last seconds ({windows}; start-up excluded), runs one at a time,",
        f"free then deterministic in each pair. Machine: {machine()}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["pong-appo", "cartpole-ppo"])
    parser.add_argument("--pairs", type=int, default=3, help="free/deterministic pairs per preset")
    parser.add_argument("--seconds", type=float, nargs="+", default=[60.0, 15.0], help="window per preset, in order")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    parser.add_argument("--out", default=str(RESULTS / "schedule"), help="results path without suffix")
    args = parser.parse_args()
    if len(args.seconds) != len(args.presets):
        parser.error(f"--seconds needs one window per preset ({len(args.presets)}), got {len(args.seconds)}")
    seconds = dict(zip(args.presets, args.seconds, strict=True))
    rows = [row for preset in args.presets for row in measure(preset, args.pairs, seconds[preset], args.overrides)]
    table = markdown(rows, args.presets, seconds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
