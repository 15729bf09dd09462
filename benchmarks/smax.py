"""SMAX (the StarCraft challenge's maps in JAX): time and env steps to a greedy win rate, and env
steps/s raw against inside training.

    python benchmarks/smax.py [--runs smax-3m-qmix smax-3m-mappo smax-2s3z-qmix] [--seeds 3]
                              [--minutes 20] [--raw-only] [--set key=value ...]
    python benchmarks/smax.py --maps [smax-3s5z-qmix smax-5m-vs-6m-qmix smax-6h-vs-8z-qmix] [--seeds 2]
                              [--first-seed 0] [--run-root runs/smax-maps] [--from-runs DIR ...]

Each run is `tianji train PRESET` as a fresh command (its time counts from the command's start:
imports, JAX compiles and process start-up included) stopping at the preset's target (3m: win
rate 0.9, 2s3z: 0.8) or after --minutes. Raw rates step a jit(vmap) batch of envs with random
available actions in a fresh interpreter, arrays converted to NumPy each step as an actor does.
Results go to benchmarks/results/smax.json (--out).

--maps: the harder maps' presets, one run at a time, each to its target or its own time limit; the
greedy win rate (the last evaluation round) at 10, 30 and 60 minutes, time to the target, env steps and
env steps/s, next to published win rates, merged by (preset, seed) into benchmarks/results/smax-maps.{md,json}
so the table grows over several sittings; --from-runs adds finished runs without training again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from math import inf
from pathlib import Path

import yaml

from common import (
    Sittings,
    curve,
    finished,
    machine,
    machines_of,
    metric_rows,
    run_tianji,
    steps_and_rate,
    summary_of,
    update_page_tables,
    value_at,
)

RESULTS = Path(__file__).parent / "results" / "smax.json"
MAPS_RESULTS = Path(__file__).parent / "results" / "smax-maps"
MAP_PRESETS = ["smax-3s5z-qmix", "smax-5m-vs-6m-qmix", "smax-6h-vs-8z-qmix"]
MAP_MARKS_MIN = (10, 30, 60)
WIN_RATE = "eval/win_rate"
# Goals: a greedy win rate within 30 minutes on 2 cores.
MAP_GOALS = {"3s5z": 0.9, "5m_vs_6m": 0.7}
# Published win rates on SMAC (StarCraft II, not SMAX): QMIX fine-tuned (pymarl2, hijkzzz/pymarl2 README,
# SC2 4.10, difficulty 7; its config trains ~10M env steps). JaxMARL publishes SMAX only as curves.
SMAC_QMIX = {"3s5z": 1.00, "5m_vs_6m": 0.90, "6h_vs_8z": 0.93, "27m_vs_30m": 1.00}
RAW = """
import json, sys, time
import numpy as np
from tianji.envs.multiagent import SmaxVectorEnv
envs = SmaxVectorEnv(sys.argv[1], int(sys.argv[2]))
obs, _ = envs.reset(seed=0)
rng = np.random.default_rng(0)
def step():
    global obs
    obs, *_ = envs.step((rng.random(obs["avail_actions"].shape) * obs["avail_actions"]).argmax(-1))
for _ in range(20):
    step()
start, steps = time.perf_counter(), 0
while time.perf_counter() - start < 3.0:
    step()
    steps += envs.num_envs
print(json.dumps(steps / (time.perf_counter() - start)))
"""


def raw_rate(map_name: str, envs: int) -> float:
    out = subprocess.run([sys.executable, "-c", RAW, map_name, str(envs)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def summarize(preset: str, rows: list[dict]) -> dict:
    reached = [r for r in rows if r["target_reached"]]
    return {
        "preset": preset,
        "seeds": len(rows),
        "reached": len(reached),
        "median_time_to_target_s": statistics.median(r["time_to_target_s"] for r in rows)
        if len(reached) == len(rows)
        else None,
        "median_env_steps_to_target": (
            statistics.median(r["env_steps_to_target"] for r in rows) if len(reached) == len(rows) else None
        ),
        "best_eval_win_rate": [r.get("best_eval_win_rate") for r in rows],
        "final_eval_win_rate": [r["final_eval_win_rate"] for r in rows],
        "training_env_steps_per_s": statistics.median(r["env_steps"] / r["wall_time_s"] for r in rows),
        "runs": [
            {
                k: r[k]
                for k in (
                    "target_reached",
                    "time_to_target_s",
                    "env_steps_to_target",
                    "env_steps",
                    "wall_time_s",
                    "final_eval_win_rate",
                    "final_win_rate100",
                )
            }
            for r in rows
        ],
    }


def best_eval_win_rate(run_dir: Path) -> float | None:
    rates = [json.loads(line).get("eval/win_rate") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r for r in rates if r is not None and r == r]
    return max(rates) if rates else None


def map_run_row(run_dir: Path) -> dict:
    """One finished run of a map's preset: win rate at each mark, time to its target, steps and rate."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = summary_of(run_dir)
    rows = metric_rows(run_dir)
    last = rows[-1]
    reached = bool(summary.get("target_reached"))
    return {
        "preset": config["name"],
        "map": config["env"]["id"].removeprefix("smax:"),
        "seed": config["seed"],
        "target": config["stop"]["target_return"],
        # a run that stopped at its target holds that win rate at the later marks
        "win_rate": {str(m): value_at(rows, WIN_RATE, m * 60, slack_s=inf if reached else 15) for m in MAP_MARKS_MIN},
        "target_reached": reached,
        "time_to_target_s": summary.get("time_to_target_s"),
        "env_steps": last["env_steps"],
        "env_steps_per_s": last["env_steps"] / last["time_s"],
        "wall_time_s": last["time_s"],
        "curve": curve(rows, WIN_RATE, every=1),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
    }


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def maps_markdown(runs: list[dict]) -> str:
    lines = [
        "| preset | seeds | greedy win rate at 10 / 30 / 60 min (each seed; a run stops at its target) | "
        "target reached (time) | env steps | env steps/s | SMAC QMIX (StarCraft II) | goal within 30 min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset in sorted({r["preset"] for r in runs}):
        seeds = sorted((r for r in runs if r["preset"] == preset), key=lambda r: r["seed"])
        game_map = seeds[0]["map"]
        rates = "; ".join(" / ".join(_rate(r["win_rate"][str(m)]) for m in MAP_MARKS_MIN) for r in seeds)
        reached = ", ".join(f"{r['time_to_target_s'] / 60:.0f} min" if r["target_reached"] else "no" for r in seeds)
        goal = MAP_GOALS.get(game_map)
        met = [r["win_rate"]["30"] is not None and r["win_rate"]["30"] >= goal for r in seeds] if goal else []
        verdict = "-" if goal is None else f"{goal:g}: {sum(met)}/{len(seeds)} seeds"
        lines.append(
            f"| `{preset}` | {len(seeds)} | {rates} | {reached} (target {seeds[0]['target']:g}) | "
            f"{steps_and_rate(seeds)} | {_rate(SMAC_QMIX.get(game_map))} | "
            f"{verdict} |"
        )
    lines += [
        "",
        "Win rate: greedy, one evaluation round of 32 episodes, the last before each mark. SMAC QMIX: pymarl2's "
        "fine-tuned QMIX on StarCraft II (hijkzzz/pymarl2, README), not SMAX; JaxMARL publishes SMAX curves, "
        f"no table. Machine: {machines_of(runs)}.",
    ]
    return "\n".join(lines) + "\n"


def maps_main(args: argparse.Namespace) -> None:
    sittings = Sittings(args.maps_out, "preset")
    for run_dir in map(Path, args.from_runs):
        sittings.add(map_run_row(run_dir))
    overrides = args.overrides + ([f"stop.max_wall_time_s={args.minutes * 60}"] if args.minutes else [])
    for preset in [] if args.from_runs else args.maps:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run_dir = Path(args.run_root) / f"{preset}-seed{seed}"
            if not finished(run_dir):  # a sitting cut short goes on with the runs it has not made
                run_tianji(preset, run_dir, seed, overrides)
            row = map_run_row(run_dir)
            sittings.add(row)
            sittings.save(maps_markdown)
            print(f"{preset} seed {seed}: win rate {row['win_rate']}, {row['env_steps']:,} env steps", flush=True)
    table = sittings.save(maps_markdown)
    print(table)
    if args.maps_out == MAPS_RESULTS:  # the project's own table, not a scratch one
        update_page_tables("smax maps table", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=["smax-3m-qmix", "smax-3m-mappo", "smax-2s3z-qmix"])
    parser.add_argument("--seeds", type=int, default=None, help="seeds per preset (default 3; --maps: 2)")
    parser.add_argument("--minutes", type=float, default=None, help="cap every run (default: the preset's)")
    parser.add_argument("--raw-only", action="store_true", help="only the raw env rates")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS})")
    parser.add_argument("--maps", nargs="*", default=None, help=f"the harder maps' presets (default {MAP_PRESETS})")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--run-root", default="runs/smax-maps", help="--maps: where the run directories are kept")
    parser.add_argument("--from-runs", nargs="+", default=[], metavar="RUN_DIR", help="--maps: finished runs to add")
    parser.add_argument("--maps-out", type=Path, default=MAPS_RESULTS, help="--maps: results path without suffix")
    args = parser.parse_args()
    if args.maps is not None:
        args.maps = args.maps or MAP_PRESETS
        args.seeds = args.seeds or 2
        maps_main(args)
        return
    raw = {f"{m} x{k}": raw_rate(m, k) for m in ("3m", "2s3z") for k in (32, 128)}
    print("raw SMAX env steps/s (one process, random available actions):")
    for name, rate in raw.items():
        print(f"  {name:<10} {rate:>10,.0f}")
    results: dict = {"raw_env_steps_per_s": raw, "training": []}
    overrides = args.overrides + ([f"stop.max_wall_time_s={args.minutes * 60}"] if args.minutes else [])
    args.seeds = args.seeds or 3
    if not args.raw_only:
        with tempfile.TemporaryDirectory() as tmp:
            for preset in args.runs:
                rows = []
                for seed in range(args.seeds):
                    run_dir = Path(tmp) / f"{preset}-{seed}"
                    row = run_tianji(preset, run_dir, seed, overrides)
                    row["best_eval_win_rate"] = best_eval_win_rate(run_dir)
                    rows.append(row)
                    print(
                        f"{preset} seed {seed}: reached {row['target_reached']} in "
                        f"{row['time_to_target_s'] or row['wall_time_s']:.0f} s, {row['env_steps']:,} env steps, "
                        f"eval win rate final {row['final_eval_win_rate']} best {row['best_eval_win_rate']}",
                        flush=True,
                    )
                results["training"].append(summarize(preset, rows))
        print(f"\n{'preset':<16} {'reached':>8} {'median s':>9} {'median steps':>13} {'train steps/s':>14}")
        for s in results["training"]:
            t, n = s["median_time_to_target_s"], s["median_env_steps_to_target"]
            print(
                f"{s['preset']:<16} {s['reached']}/{s['seeds']:<6} {'-' if t is None else f'{t:.0f}':>9} "
                f"{'-' if n is None else f'{n:,.0f}':>13} {s['training_env_steps_per_s']:>14,.0f}"
            )
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
