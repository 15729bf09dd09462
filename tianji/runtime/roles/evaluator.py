"""Evaluator: greedy episodes on the newest weights, in its own role (off the learner's path).

evaluator = build_evaluator(cfg)
evaluator.set_weights(version, weights)
event = evaluator.evaluate()   # {"kind": "eval", "return_mean": ..., "version": ...}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tianji.algos.base import ActorPolicy
from tianji.envs.make import VectorEnvLike
from tianji.runtime.shared.events import EvalEvent

MAX_EVAL_STEPS = 100_000  # guard for envs without a time limit


class Evaluator:
    def __init__(self, envs: VectorEnvLike, policy: ActorPolicy[Any], seed: int):
        self.envs = envs
        self.policy = policy
        self.seed = seed
        self.version = -1
        self.evaluated_version = -1
        self.busy_s = 0.0
        self.bad_messages = 0

    def set_weights(self, version: int, weights: Mapping[str, np.ndarray], force: bool = False) -> None:
        """Newer weights win; `force` takes any (a restarted learner counts from its checkpoint)."""
        if force or version > self.version:
            self.policy.load_weights(weights)
            self.version = version
            if force:
                self.evaluated_version = -1

    def has_new_weights(self) -> bool:
        return self.version > self.evaluated_version

    def evaluate(self) -> EvalEvent:
        """One episode per env of the vector env, each counted until its first end."""
        start = time.perf_counter()
        played = play_greedy(self.envs, self.policy, self.seed + max(self.version, 0))
        self.evaluated_version = self.version
        self.busy_s += time.perf_counter() - start
        returns = played.returns
        event: EvalEvent = {
            "kind": "eval",
            "role": "evaluator",
            "return_mean": float(returns.mean()),
            "return_min": float(returns.min()),
            "length_mean": float(played.lengths.mean()),
            "version": self.version,
            "episodes": len(returns),
        }
        if played.won is not None:
            event["win_rate"] = float(played.won.mean())
        return event


@dataclass
class Played:
    """The first episode of every env: game score, length, and whether it was won (envs with wins)."""

    returns: np.ndarray
    lengths: np.ndarray
    won: np.ndarray | None


def play_greedy(
    envs: VectorEnvLike, policy: ActorPolicy[Any], seed: int, on_step: Callable[[Any, np.ndarray], None] | None = None
) -> Played:
    """Greedy actions until every env of `envs` has ended one episode. `on_step(obs, running)` sees
    every observation (for videos)."""
    n = envs.num_envs
    obs, _ = envs.reset(seed=seed)
    returns = np.zeros(n)
    lengths = np.zeros(n, dtype=np.int64)
    records_wins = "won" in getattr(envs, "recorded_info", ())
    won = np.zeros(n, dtype=bool)
    running = np.ones(n, dtype=bool)
    for _ in range(MAX_EVAL_STEPS):
        if on_step is not None:
            on_step(obs, running)
        obs, reward, terminated, truncated, info = envs.step(policy.greedy(obs))
        returns += np.where(running, reward, 0.0)
        lengths += running
        if records_wins:
            won |= running & np.asarray(info["won"], bool)
        running &= ~(terminated | truncated)
        if not running.any():
            break
    return Played(returns, lengths, won if records_wins else None)
