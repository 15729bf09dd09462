"""Wall time and env steps to a 100-episode mean training return >= 475 on CartPole-v1 (preset cartpole-ppo).

    python benchmarks/cartpole_ppo.py [--seeds 5] [--launcher local|ray|inline] [--set key=value ...]
    python benchmarks/cartpole_ppo.py --ray-modes     # local, ray joining a running cluster, ray on its own

Runs `tianji train cartpole-ppo` once per seed as a fresh command, one after another, and prints
per-seed numbers and the medians. `time_to_target_s` counts from the command's start (imports,
process start-up and, with --launcher ray, starting a one-node Ray instance included). With a
launcher other than local, the local launcher runs beside it, seed by seed, and the ratio of the
medians is printed. `--ray-modes` starts a cluster (`ray start --head`, a fresh token) for the
benchmark and runs three commands in turn per seed: local, `--launcher ray --address auto` (joining
it) and `--launcher ray` (a Ray instance of its own), then prints both ratios to local. Each command
starts after `--pause` seconds of quiet, so none pays for the previous one's exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import run_tianji


def report(launcher: str, rows: list[dict]) -> float | None:
    print(f"\nlauncher {launcher}")
    print(
        f"{'seed':>4} {'reached':>8} {'time_to_target_s':>17} {'env_steps':>10} {'final_mean100':>14} "
        f"{'lag_mean':>8} {'lag_max':>7}"
    )
    for seed, r in enumerate(rows):
        t = r["time_to_target_s"]
        print(
            f"{seed:>4} {str(r['target_reached']):>8} {t if t is None else round(t, 2)!s:>17} "
            f"{r['env_steps_to_target']!s:>10} {r['final_return_mean100']:>14.1f} "
            f"{r['policy_lag_mean']:>8.2f} {r['policy_lag_max']:>7}"
        )
    reached = [r for r in rows if r["target_reached"]]
    print(f"reached the target: {len(reached)}/{len(rows)}")
    if len(reached) != len(rows):
        print("median over all seeds is undefined: some seeds missed the target (see stop.max_wall_time_s)")
        return None
    median = statistics.median(r["time_to_target_s"] for r in rows)
    print(f"median time to target: {median:.2f} s (from command start)")
    print(f"median env steps to target: {statistics.median(r['env_steps_to_target'] for r in rows):,.0f}")
    return median


@contextlib.contextmanager
def ray_cluster(home: Path):
    """A one-node cluster started as the README says (token first), stopped afterwards."""
    ray = str(Path(sys.executable).parent / "ray")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
        "HOME": str(home),
        "RAY_AUTH_MODE": "token",
    }
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    subprocess.run([ray, "start", "--head", "--port=6379"], env=env, check=True, capture_output=True)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--preset", default="cartpole-ppo")
    parser.add_argument("--launcher", choices=["local", "ray", "inline"], default="local")
    parser.add_argument("--ray-modes", action="store_true", help="local vs ray joining a cluster vs ray on its own")
    parser.add_argument(
        "--pause",
        type=float,
        default=3.0,
        help="seconds of quiet before each command (the last one's processes finish exiting)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    args = parser.parse_args()
    if args.ray_modes:  # label -> (launcher, extra overrides)
        modes = {"local": ("local", []), "ray-join": ("ray", ["ray.address=auto"]), "ray-own": ("ray", [])}
    else:
        modes = {args.launcher: (args.launcher, [])}
        if args.launcher != "local":
            modes["local"] = ("local", [])
    rows: dict[str, list[dict]] = {label: [] for label in modes}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ray_cluster(Path(tmp) / "home") if args.ray_modes else contextlib.nullcontext()
        with cluster:
            for seed in range(args.seeds):  # launchers take turns, so drift hits both alike
                for label, (launcher, extra) in modes.items():
                    time.sleep(args.pause)
                    rows[label].append(
                        run_tianji(
                            args.preset, Path(tmp) / f"{label}-seed{seed}", seed, [*args.overrides, *extra], launcher
                        )
                    )
    medians = {label: report(label, label_rows) for label, label_rows in rows.items()}
    for label, median in medians.items():
        if label != "local" and median is not None and medians.get("local"):
            print(f"\n{label} / local, median time to target: {median / medians['local']:.2f}")


if __name__ == "__main__":
    main()
