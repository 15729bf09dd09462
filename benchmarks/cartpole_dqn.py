"""Wall time and env steps to a greedy evaluation mean return >= 475 (20 episodes) on CartPole-v1:
TianJi's DQN preset over several seeds, and Stable-Baselines3 DQN with the rl-zoo tuned
hyperparameters side by side in the same run (when `stable-baselines3` is installed).

    python benchmarks/cartpole_dqn.py [--seeds 5] [--preset cartpole-dqn] [--sb3-seeds 3] [--sb3-max-s 420]

TianJi's time counts from its command's start (imports, process start-up and everything else
included); its evaluation runs in its own role, in parallel. SB3's time counts from its process
start too and is reported twice: with the time SB3 spends in its own evaluation (20 greedy
episodes every 2,000 env steps, serial), which is the issue's criterion (wall clock from command
start), and without it, which favours SB3. Each run is a fresh process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import run_tianji

TARGET = 475.0

SB3_SCRIPT = textwrap.dedent("""
    import json, sys, time
    T0 = time.time()
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    seed, max_s, target = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    # rl-baselines3-zoo hyperparams/dqn.yml, CartPole-v1 (n_timesteps 5e4, exploration_fraction 0.16:
    # epsilon decays over the first 8,000 steps; kept so with a longer budget)
    total = 2_000_000
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_rate=2.3e-3, batch_size=64, buffer_size=100_000,
                learning_starts=1000, gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
                exploration_fraction=0.16 * 5e4 / total, exploration_final_eps=0.04,
                policy_kwargs=dict(net_arch=[256, 256]), seed=seed, verbose=0)
    eval_env = gym.make("CartPole-v1")

    class Stop(BaseCallback):
        def __init__(self):
            super().__init__()
            self.eval_s, self.result = 0.0, None
        def _on_step(self):
            if self.num_timesteps % 2000 == 0:
                start = time.time()
                mean, _ = evaluate_policy(self.model, eval_env, n_eval_episodes=20, deterministic=True)
                self.eval_s += time.time() - start
                if mean >= target:
                    self.result = {"reached": True, "time_s": time.time() - T0,
                                   "time_without_eval_s": time.time() - T0 - self.eval_s,
                                   "env_steps": self.num_timesteps}
                    return False
            if time.time() - T0 > max_s:
                self.result = {"reached": False, "time_s": None, "time_without_eval_s": None,
                               "env_steps": self.num_timesteps}
                return False
            return True

    stop = Stop()
    model.learn(total, callback=stop)
    print(json.dumps(stop.result))
""")


def run_ours(seed: int, preset: str, overrides: list[str], root: Path) -> dict:
    s = run_tianji(preset, root / f"{preset}-seed{seed}", seed, overrides)
    return {"reached": s["target_reached"], "time_s": s["time_to_target_s"], "env_steps": s["env_steps_to_target"]}


def run_sb3(seed: int, max_s: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SB3_SCRIPT, str(seed), str(max_s), str(TARGET)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(name: str, rows: list[dict], key: str = "time_s") -> float | None:
    print(f"\n{name}")
    print(f"{'seed':>4} {'reached':>8} {'time_s':>8} {'env_steps':>10}")
    for seed, r in enumerate(rows):
        t = "-" if r[key] is None else f"{r[key]:.1f}"
        print(f"{seed:>4} {str(r['reached']):>8} {t:>8} {str(r['env_steps']):>10}")
    reached = sum(r["reached"] for r in rows)
    # a seed that missed counts as +infinity, so the median is defined only when most seeds reached
    times = sorted(r[key] if r["reached"] else float("inf") for r in rows)
    median = statistics.median(times)
    print(
        f"reached {reached}/{len(rows)}; median time to target: "
        f"{'not reached' if median == float('inf') else f'{median:.1f} s'}"
    )
    return None if median == float("inf") else median


def speedup(label: str, ours: float | None, theirs: float | None, cap: float) -> None:
    if ours is None:
        print(f"{label}: TianJi's median did not reach the target")
    elif theirs is None:
        print(f"{label}: SB3's median did not reach the target within {cap:.0f} s: at least {cap / ours:.1f}x")
    else:
        print(f"{label}: {theirs / ours:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--preset", default="cartpole-dqn")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--sb3-seeds", type=int, default=3)
    parser.add_argument("--sb3-max-s", type=float, default=420.0)
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        ours = [run_ours(seed, args.preset, args.overrides, Path(tmp)) for seed in range(args.seeds)]
    ours_median = report(f"TianJi {args.preset}", ours)
    if args.sb3_seeds == 0:
        return
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        print("\nstable-baselines3 is not installed (pip install -e '.[bench]'): no side-by-side comparison")
        return
    theirs = [run_sb3(seed, args.sb3_max_s) for seed in range(args.sb3_seeds)]
    cap = args.sb3_max_s
    with_eval = report(
        f"Stable-Baselines3 DQN (rl-zoo hyperparameters, cap {cap:.0f} s), wall clock from command start", theirs
    )
    without_eval = report(
        "Stable-Baselines3 DQN, same runs, its evaluation time left out", theirs, key="time_without_eval_s"
    )
    print()
    speedup("speed-up, median SB3 / median TianJi (both wall clock from command start)", ours_median, with_eval, cap)
    speedup("speed-up, SB3's evaluation time left out", ours_median, without_eval, cap)
    print(f"benchmark wall time: {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
