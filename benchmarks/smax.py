"""SMAX (the StarCraft challenge's maps in JAX): time and env steps to a greedy win rate, and env
steps/s raw against inside training.

    python benchmarks/smax.py [--runs smax-3m-qmix smax-3m-mappo smax-2s3z-qmix] [--seeds 3]
                              [--minutes 20] [--raw-only] [--set key=value ...]

Each run is `tianji train PRESET` as a fresh command (its time counts from the command's start:
imports, JAX compiles and process start-up included) stopping at the preset's target (3m: win
rate 0.9, 2s3z: 0.8) or after --minutes. Raw rates step a jit(vmap) batch of envs with random
available actions in a fresh interpreter, arrays converted to NumPy each step as an actor does.
Results go to benchmarks/results/smax.json (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import run_tianji

RESULTS = Path(__file__).parent / "results" / "smax.json"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=["smax-3m-qmix", "smax-3m-mappo", "smax-2s3z-qmix"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=None, help="cap every run (default: the preset's)")
    parser.add_argument("--raw-only", action="store_true", help="only the raw env rates")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS})")
    args = parser.parse_args()
    raw = {f"{m} x{k}": raw_rate(m, k) for m in ("3m", "2s3z") for k in (32, 128)}
    print("raw SMAX env steps/s (one process, random available actions):")
    for name, rate in raw.items():
        print(f"  {name:<10} {rate:>10,.0f}")
    results: dict = {"raw_env_steps_per_s": raw, "training": []}
    overrides = args.overrides + ([f"stop.max_wall_time_s={args.minutes * 60}"] if args.minutes else [])
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
