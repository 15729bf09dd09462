"""Wall time and env steps to a 100-episode mean training return >= 475 on CartPole-v1 (preset cartpole-ppo).

    python benchmarks/cartpole_ppo.py [--seeds 5] [--launcher local|ray|inline] [--set key=value ...]

Runs `tianji train cartpole-ppo` once per seed as a fresh command, one after another, and prints
per-seed numbers and the medians. `time_to_target_s` counts from the command's start (imports,
process start-up and, with --launcher ray, starting a one-node Ray instance included). With a
launcher other than local, the local launcher runs beside it, seed by seed, and the ratio of the
medians is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_tianji


def report(launcher: str, rows: list[dict]) -> float | None:
    print(f"\nlauncher {launcher}")
    print(f"{'seed':>4} {'reached':>8} {'time_to_target_s':>17} {'env_steps':>10} {'final_mean100':>14} "
          f"{'lag_mean':>8} {'lag_max':>7}")
    for seed, r in enumerate(rows):
        t = r["time_to_target_s"]
        print(f"{seed:>4} {str(r['target_reached']):>8} {t if t is None else round(t, 2)!s:>17} "
              f"{r['env_steps_to_target']!s:>10} {r['final_return_mean100']:>14.1f} "
              f"{r['policy_lag_mean']:>8.2f} {r['policy_lag_max']:>7}")
    reached = [r for r in rows if r["target_reached"]]
    print(f"reached the target: {len(reached)}/{len(rows)}")
    if len(reached) != len(rows):
        print("median over all seeds is undefined: some seeds missed the target (see stop.max_wall_time_s)")
        return None
    median = statistics.median(r["time_to_target_s"] for r in rows)
    print(f"median time to target: {median:.2f} s (from command start)")
    print(f"median env steps to target: {statistics.median(r['env_steps_to_target'] for r in rows):,.0f}")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--preset", default="cartpole-ppo")
    parser.add_argument("--launcher", choices=["local", "ray", "inline"], default="local")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    args = parser.parse_args()
    launchers = [args.launcher] + (["local"] if args.launcher != "local" else [])
    rows: dict[str, list[dict]] = {launcher: [] for launcher in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):  # launchers take turns, so drift hits both alike
            for launcher in launchers:
                rows[launcher].append(run_tianji(args.preset, Path(tmp) / f"{launcher}-seed{seed}", seed,
                                                 args.overrides, launcher))
    medians = {launcher: report(launcher, launcher_rows) for launcher, launcher_rows in rows.items()}
    if len(launchers) == 2 and None not in medians.values():
        print(f"\n{args.launcher} / local, median time to target: {medians[args.launcher] / medians['local']:.2f}")


if __name__ == "__main__":
    main()
