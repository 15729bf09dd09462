"""Prioritized replay throughput at capacity 1M: inserts/s, sampled transitions/s (batch 256), and
sampling's share of a learner step on the cartpole-dqn network.

    python benchmarks/replay.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from tianji.algos.common.replay import PrioritizedReplay
from tianji.config import load_config

CAPACITY = 1 << 20
BATCH = 256
OBS = (4,)


def timed(fn, repeats: int) -> float:
    """Median seconds per call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    fields = {
        "obs": (OBS, np.float32),
        "next_obs": (OBS, np.float32),
        "action": ((), np.int64),
        "nstep_return": ((), np.float32),
        "discount": ((), np.float32),
    }
    replay = PrioritizedReplay(CAPACITY, fields, alpha=0.6)
    chunk = 4096  # transitions per insert call (a few fragments)
    data = {
        "obs": rng.random((chunk, *OBS), dtype=np.float32),
        "next_obs": rng.random((chunk, *OBS), dtype=np.float32),
        "action": rng.integers(0, 2, chunk),
        "nstep_return": rng.random(chunk, dtype=np.float32),
        "discount": np.full(chunk, 0.97, np.float32),
    }
    priorities = rng.random(chunk)
    start = time.perf_counter()
    while len(replay) < CAPACITY:
        replay.add(data, priorities)
    fill_s = time.perf_counter() - start
    insert_s = timed(lambda: replay.add(data, priorities), 50)
    sample_s = timed(lambda: replay.sample(BATCH, 0.4, rng), 200)
    idx, _, _ = replay.sample(BATCH, 0.4, rng)
    update_s = timed(lambda: replay.update_priorities(idx, rng.random(BATCH)), 200)

    import gymnasium as gym

    from tianji.algos.dqn import DQNLearner

    cfg = load_config("cartpole-dqn", ["algo.batch_size=256", f"algo.buffer_capacity={CAPACITY}"]).algo
    learner = DQNLearner(cfg, gym.spaces.Box(-np.inf, np.inf, OBS, np.float32), gym.spaces.Discrete(2))
    learner.replay = replay
    step_s = timed(learner.update, 200)

    print(f"capacity {CAPACITY:,}, batch {BATCH}, obs {OBS}")
    print(f"fill to capacity:        {CAPACITY / fill_s:12,.0f} inserts/s")
    print(f"insert ({chunk} at a time): {chunk / insert_s:12,.0f} inserts/s")
    print(f"sample (batch {BATCH}):      {BATCH / sample_s:12,.0f} transitions/s  ({sample_s * 1e6:.0f} us per batch)")
    print(f"priority update ({BATCH}):   {BATCH / update_s:12,.0f} updates/s      ({update_s * 1e6:.0f} us per batch)")
    print(f"learner step (sample + loss + backward + priorities): {step_s * 1e3:.2f} ms")
    print(
        f"sampling share of a learner step: {sample_s / step_s:.0%}; with priority update: "
        f"{(sample_s + update_s) / step_s:.0%}"
    )


if __name__ == "__main__":
    main()
