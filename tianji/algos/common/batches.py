"""What on-policy learners do with a batch of fragments: lay them side by side, then take minibatch steps.

    steps = time_major(fragments, ("obs", "action", "logp", "reward"), device, per_env=("last_obs",))
    stats = minibatch_steps(samples, cfg, loss_of, step, sync, env_steps)  # cfg.epochs x cfg.minibatches steps

Fragments are shaped [T, k, ...] (per-env extras such as the observation after the fragment [k, ...]);
a batch of several is one [T, k1 + k2, ...] array per key, so returns are computed per env as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import numpy as np
import torch

from tianji.algos.common.optim import GradientHook, GradientStep, Stats
from tianji.algos.common.tensors import to_device


class EpochSettings(Protocol):
    @property
    def epochs(self) -> int: ...
    @property
    def minibatches(self) -> int: ...


Loss = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, Stats]]


def joined(fragments: list[Mapping[str, np.ndarray]], key: str, axis: int) -> np.ndarray:
    """One key of every fragment, side by side on the env axis (no copy for a single fragment)."""
    arrays = [f[key] for f in fragments]
    return np.concatenate(arrays, axis=axis) if len(arrays) > 1 else arrays[0]


def time_major(
    fragments: list[Mapping[str, np.ndarray]], keys: Iterable[str], device: torch.device, per_env: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """`keys` as [T, K, ...] tensors and `per_env` extras as [K, ...]; uint8 stays uint8 until the net."""
    return {
        **{key: to_device(joined(fragments, key, 1), device) for key in keys},
        **{key: to_device(joined(fragments, key, 0), device) for key in per_env},
    }


def minibatch_steps(
    samples: dict[str, torch.Tensor],
    cfg: EpochSettings,
    loss_of: Loss,
    step: GradientStep,
    sync: GradientHook,
    env_steps: int,
) -> dict[str, float]:
    """`cfg.epochs` passes of `cfg.minibatches` gradient steps on random samples (rows of every
    tensor in `samples`); the mean of each stat over the steps."""
    n = next(iter(samples.values())).shape[0]
    size = max(1, n // cfg.minibatches)
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, device=next(iter(samples.values())).device)
        for start in range(0, n - size + 1, size):
            rows = order[start : start + size]
            loss, stats = loss_of({key: value.index_select(0, rows) for key, value in samples.items()})
            stats.update(step(loss, sync, env_steps))
            step.observe(stats)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            steps += 1
    return {key: value / max(steps, 1) for key, value in totals.items()}
