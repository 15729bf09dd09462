"""What a run that repeats costs: env steps/s of `balance.schedule: deterministic` against the free
asynchronous schedule, side by side on the same cores.

    python benchmarks/schedule.py [--presets pong-appo cartpole-ppo] [--pairs 3] [--seconds 60 15]
                                  [--repeats 5] [--repeat-preset cartpole-ppo]

Each pair runs the preset free, then deterministic, one command at a time (A B A B ...); a run's rate is
its env steps/s over its last SECONDS (start-up excluded), with the actors' and the learner's busy
shares and the mean policy lag over the same window. Per preset: every pair's ratio deterministic / free
and their median. Then what a comparison gains: the repeat preset run to its target REPEATS times with
one seed under each schedule, alternating; the spread of its env steps to the target is what timing
alone adds to a free run (a deterministic one repeats to the step). `--pairs 0` or `--repeats 0` skips
a part and keeps its earlier results. Results: benchmarks/results/schedule.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import machine, run_tianji, steady_rate

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


def repeat(preset: str, repeats: int, overrides: list[str]) -> list[dict]:
    """The preset to its target `repeats` times with seed 0 under each schedule, alternating: one row per run."""
    rows = []
    for attempt in range(repeats):
        for schedule in SCHEDULES:
            with tempfile.TemporaryDirectory() as tmp:
                summary = run_tianji(preset, Path(tmp) / "run", 0, [f"balance.schedule={schedule}", *overrides])
            row = {key: summary[key] for key in ("target_reached", "env_steps_to_target", "time_to_target_s")}
            rows.append({"preset": preset, "attempt": attempt, "schedule": schedule, **row})
            print(f"{preset} seed 0 {schedule:>13}: {row}", flush=True)
    return rows


def repeats_markdown(rows: list[dict]) -> str:
    lines = [
        "| preset | schedule | runs of seed 0 | env steps to target (each run) | spread (max / min)"
        " | seconds (median) |",
        "|---|---|---|---|---|---|",
    ]
    for schedule in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == schedule and r["target_reached"]]
        if not mine:
            continue
        steps = [r["env_steps_to_target"] for r in mine]
        lines.append(
            f"| {mine[0]['preset']} | {schedule} | {len(mine)} | {', '.join(f'{s:,}' for s in steps)}"
            f" | {max(steps) / min(steps):.2f} | {statistics.median(r['time_to_target_s'] for r in mine):.1f} |"
        )
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--repeats", type=int, default=5, help="runs of seed 0 to the target under each schedule")
    parser.add_argument("--repeat-preset", default="cartpole-ppo")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    parser.add_argument("--out", default=str(RESULTS / "schedule"), help="results path without suffix")
    args = parser.parse_args()
    if len(args.seconds) != len(args.presets):
        parser.error(f"--seconds needs one window per preset ({len(args.presets)}), got {len(args.seconds)}")
    out = Path(args.out)
    earlier = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    seconds = dict(zip(args.presets, args.seconds, strict=True))
    pairs = [row for preset in args.presets for row in measure(preset, args.pairs, seconds[preset], args.overrides)]
    results = {
        "pairs": pairs if args.pairs else earlier.get("pairs", []),
        "seconds": seconds if args.pairs else earlier.get("seconds", {}),
        "repeats": repeat(args.repeat_preset, args.repeats, args.overrides) if args.repeats else [],
    }
    results["repeats"] = results["repeats"] or earlier.get("repeats", [])
    presets = list(results["seconds"])
    table = markdown(results["pairs"], presets, results["seconds"]) if results["pairs"] else ""
    table += "\n" + repeats_markdown(results["repeats"]) if results["repeats"] else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
