"""Actor: k vectorized envs plus batched policy inference, cut into fixed-size fragments.

    actor = Actor(actor_id=0, envs=make_vector_env(cfg.env, 16), policy=policy, fragment_length=32, seed=0)
    fragment = actor.collect()          # 32 steps x 16 envs, stamped with actor.version
    actor.set_weights(version, weights) # newest weights win, applied between fragments

Recording convention (per row t, per env): `obs` seen, what the policy recorded
(`action`, extras), `reward`, `terminated`, `done` (terminated or truncated), and
`valid`. Vector envs reset a finished env on the following step; that step is
recorded with `valid = False` (its obs is the final observation, its reward 0),
so algorithms can bootstrap truncated episodes from it and mask it from losses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from tianji.algos.base import ActorPolicy, Arrays


@dataclass
class Fragment:
    arrays: Arrays
    actor_id: int
    seq: int
    policy_version: int
    env_steps: int


class Actor:
    def __init__(self, actor_id: int, envs: Any, policy: ActorPolicy, fragment_length: int, seed: int):
        self.actor_id = actor_id
        self.envs = envs
        self.policy = policy
        self.T = fragment_length
        self.k = envs.num_envs
        self.obs, _ = envs.reset(seed=seed)
        self.prev_done = np.zeros(self.k, dtype=bool)
        self.version = 0
        self.seq = 0
        self._return = np.zeros(self.k, dtype=np.float64)
        self._length = np.zeros(self.k, dtype=np.int64)
        self.episodes: list[tuple[float, int]] = []  # finished (return, length), drained by the caller
        self.busy_s = 0.0
        self._buffers: Arrays | None = None

    def set_weights(self, version: int, weights: Mapping[str, np.ndarray], force: bool = False) -> None:
        """Newest weights win; `force` takes older ones too (a restarted learner counts from its checkpoint)."""
        if force or version >= self.version:
            self.policy.load_weights(weights)
            self.version = version

    def collect(self) -> Fragment:
        """Step the envs T times and return one fragment stamped with the current version."""
        start = time.perf_counter()
        version = self.version
        for t in range(self.T):
            self._step(t)
        arrays = {k: v.copy() for k, v in self._buffers.items()}  # type: ignore[union-attr]
        arrays.update(self.policy.finish_fragment(arrays, self.obs))
        fragment = Fragment(arrays, self.actor_id, self.seq, version, self.T * self.k)
        self.seq += 1
        self.busy_s += time.perf_counter() - start
        return fragment

    def drain_episodes(self) -> list[tuple[float, int]]:
        episodes, self.episodes = self.episodes, []
        return episodes

    def _step(self, t: int) -> None:
        obs = self.obs
        env_action, record = self.policy.act(obs)
        next_obs, reward, terminated, truncated, _ = self.envs.step(env_action)
        done = np.logical_or(terminated, truncated)
        valid = ~self.prev_done
        row = {"obs": obs, **record, "reward": reward, "terminated": terminated, "done": done, "valid": valid}
        if self._buffers is None:
            self._buffers = {k: np.zeros((self.T, *np.shape(v)), dtype=np.asarray(v).dtype) for k, v in row.items()}
        for key, value in row.items():
            self._buffers[key][t] = value
        self._track_episodes(reward, done, valid)
        self.prev_done = done
        self.obs = next_obs

    def _track_episodes(self, reward: np.ndarray, done: np.ndarray, valid: np.ndarray) -> None:
        self._return += np.where(valid, reward, 0.0)
        self._length += valid
        for i in np.flatnonzero(done & valid):
            self.episodes.append((float(self._return[i]), int(self._length[i])))
        self._return[done] = 0.0
        self._length[done] = 0
