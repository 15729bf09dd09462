"""Actor: k vectorized envs plus batched policy inference, cut into fixed-size fragments.

    actor = Actor(actor_id=0, envs=make_vector_env(cfg.env, 16), policy=policy, fragment_length=32, seed=0)
    fragment = actor.collect()          # 32 steps x 16 envs, stamped with actor.version
    fragment = actor.collect(out=views) # the same, written straight into `views` (a shared-memory slot)
    actor.set_weights(version, weights) # newest weights win, applied between fragments
    fragment = actor.collect(between_steps=refresh)  # or between steps: refresh() may call set_weights

Recording convention (per row t, per env): `obs` seen, what the policy recorded
(`action`, extras), `reward`, `terminated`, `done` (terminated or truncated), and
`valid`. Dict observations (multi-agent envs: obs, state, avail_actions, ...) are recorded
one field per key, and so are the per-step infos an env names in `recorded_info` (e.g. `won`).
An env may name in `terminal_info` an info key whose True marks a step the learner treats as
terminated although the episode goes on (Atari's lost life, env.episodic_life): `terminated` is
recorded True there, `done` is not, and the episode's return runs on. Vector envs reset a finished
env on the following step; that step is
recorded with `valid = False` (its obs is the final observation, its reward 0),
so algorithms can bootstrap truncated episodes from it and mask it from losses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tianji.algos.base import ActorPolicy
from tianji.algos.common.tensors import Arrays
from tianji.envs.make import VectorEnvLike
from tianji.runtime.shared.randomness import OwnRandom


@dataclass
class Fragment:
    arrays: Arrays
    actor_id: int
    seq: int
    policy_version: int
    env_steps: int


class Actor:
    def __init__(
        self,
        actor_id: int,
        envs: VectorEnvLike,
        policy: ActorPolicy[Any],
        fragment_length: int,
        seed: int,
        reward_clip: float | None = None,
    ):
        self.actor_id = actor_id
        self.envs = envs
        self.policy = policy
        self.T = fragment_length
        self.reward_clip = reward_clip  # training rewards only; episode returns stay the real score
        self.k = envs.num_envs
        self.obs, _ = envs.reset(seed=seed)
        self.prev_done = np.zeros(self.k, dtype=bool)
        self.version = 0
        self.seq = 0
        self._return = np.zeros(self.k, dtype=np.float64)
        self._length = np.zeros(self.k, dtype=np.int64)
        self.recorded_info: tuple[str, ...] = tuple(getattr(envs, "recorded_info", ()))
        self.terminal_info: str | None = getattr(envs, "terminal_info", None)
        self.episodes: list[tuple[float, ...]] = []  # finished (return, length[, won]), drained by the caller
        self.episode_fragments: list[int] = []  # the seq of the fragment each of them ended in
        self.busy_s = 0.0
        self.own_random: OwnRandom | None = None  # its own torch stream (balance.schedule deterministic)

    def set_weights(self, version: int, weights: Mapping[str, np.ndarray], force: bool = False) -> None:
        """Newest weights win; `force` takes older ones too (a restarted learner counts from its checkpoint)."""
        if force or version >= self.version:
            self.policy.load_weights(weights)
            self.version = version

    def collect(self, out: Arrays | None = None, between_steps: Callable[[], None] | None = None) -> Fragment:
        """Step the envs T times and return one fragment stamped with the version it started with.

        `out`: arrays laid out like the previous fragment's (`layout()`), e.g. views of a shared-memory
        slot: every step's rows are written straight into them, and so is what the policy adds at the
        end; nothing is copied afterwards. Without it the fragment gets arrays of its own.
        `between_steps`: called before every step after the first (e.g. to take newer weights).
        """
        start = time.perf_counter()
        version = self.version
        buffers = out
        for t in range(self.T):
            if t and between_steps is not None:
                between_steps()
            buffers = self._step(t, buffers)
        arrays = dict(buffers)  # type: ignore[arg-type]
        for key, value in self.policy.finish_fragment(arrays, self.obs).items():
            if out is not None:
                out[key][...] = value
            else:
                arrays[key] = np.array(value)  # its own memory: the fragment may outlive the env's buffers
        fragment = Fragment(out if out is not None else arrays, self.actor_id, self.seq, version, self.T * self.k)
        self.seq += 1
        self.busy_s += time.perf_counter() - start
        return fragment

    def drain_episodes(self) -> list[tuple[float, ...]]:
        episodes, self.episodes = self.episodes, []
        self.episode_fragments = self.episode_fragments[len(episodes) :]
        return episodes

    def drain_episodes_and_fragments(self) -> tuple[list[tuple[float, ...]], list[int]]:
        """Finished episodes and, for each, the number (seq) of the fragment it ended in."""
        fragments = self.episode_fragments[: len(self.episodes)]
        return self.drain_episodes(), fragments

    def _step(self, t: int, buffers: Arrays | None) -> Arrays:
        obs = self.obs
        obs_rows = obs if isinstance(obs, dict) else {"obs": obs}
        if buffers is not None:  # the observation's rows first: some envs reuse their output arrays
            for key, value in obs_rows.items():
                buffers[key][t] = value
        else:  # nowhere to write them yet: keep a copy, the step below may overwrite the env's arrays
            obs_rows = {key: np.array(value) for key, value in obs_rows.items()}
        if self.own_random is None:
            env_action, record = self.policy.act(obs)
        else:
            with self.own_random.drawing():
                env_action, record = self.policy.act(obs)
        next_obs, reward, terminated, truncated, info = self.envs.step(env_action)
        done = np.logical_or(terminated, truncated)
        if self.terminal_info is not None:  # a terminal for the learner only: the episode goes on
            terminated = np.logical_or(terminated, info[self.terminal_info])
        valid = ~self.prev_done
        trained = reward if self.reward_clip is None else np.clip(reward, -self.reward_clip, self.reward_clip)
        row = {
            **record,
            "reward": np.asarray(trained, np.float32),
            "terminated": terminated,
            "done": done,
            "valid": valid,
            **{key: np.asarray(info[key]) for key in self.recorded_info},
        }
        if buffers is None:  # a fragment of its own: allocate its arrays now that the rows' shapes are known
            buffers = {k: np.empty((self.T, *np.shape(v)), np.asarray(v).dtype) for k, v in {**obs_rows, **row}.items()}
            for key, value in obs_rows.items():
                buffers[key][t] = value
        for key, value in row.items():
            buffers[key][t] = value
        self._track_episodes(reward, done, valid, info.get("won") if "won" in self.recorded_info else None)
        self.prev_done = done
        self.obs = next_obs
        return buffers

    def _track_episodes(self, reward: np.ndarray, done: np.ndarray, valid: np.ndarray, won: Any = None) -> None:
        self._return += np.where(valid, reward, 0.0)
        self._length += valid
        for i in np.flatnonzero(done & valid):
            episode = (float(self._return[i]), int(self._length[i]))
            self.episodes.append(episode if won is None else (*episode, bool(won[i])))
            self.episode_fragments.append(self.seq)
        self._return[done] = 0.0
        self._length[done] = 0
