"""Learner: owns its buffer (through the algorithm), trains as data arrives, versions its weights.

    learner = Learner(algo_learner, max_policy_lag=8, limiter=RateLimiter(target=4.0, tolerance=0.1))
    if learner.wants_data():
        learner.consume(fragment)   # False when dropped as too stale
    while learner.ready():
        stats = learner.update()    # version += 1
    publish(learner.version, learner.weights())

Knows nothing of any algorithm beyond the `AlgoLearner` interface.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tianji.algos.base import AlgoLearner
from tianji.algos.common.tensors import Arrays
from tianji.runtime.balance import LagStats, RateLimiter
from tianji.runtime.roles.actor import Fragment
from tianji.runtime.shared.randomness import OwnRandom
from tianji.runtime.sync import NoSync

VERSIONS_EMA = 0.2


class Learner:
    def __init__(
        self,
        algo: AlgoLearner,
        max_policy_lag: int,
        limiter: RateLimiter | None = None,
        backpressure: bool = True,
        sync: NoSync | None = None,
    ):
        self.algo = algo
        self.sync: NoSync | None = None  # with a learner group: gradients hook, parameter averages
        if sync is not None:
            self.attach_sync(sync)
        self.backpressure = backpressure
        self.version = 0
        self.lag = LagStats(max_policy_lag)
        self.limiter = limiter or RateLimiter(target=None, tolerance=0.0)
        self.updates = 0
        self.samples_trained = 0
        self.fragments_consumed = 0
        self.env_steps_consumed = 0  # in fragments taken (all learners of a group: about this x group_size)
        self.group_size = 1
        self.busy_s = 0.0
        self.last_stats: dict[str, float] = {}
        self.backlog: deque[Fragment] = deque()  # only without back-pressure
        # learner versions between two fragments taken, averaged: what one fragment in flight adds to the
        # lag of the next (1 for PPO with one fragment per batch; updates per fragment for DQN)
        self.versions_per_fragment = 1.0
        self._version_at_last_admit: int | None = None
        self.own_random: OwnRandom | None = None  # its own torch stream (balance.schedule deterministic)

    def consume(self, fragment: Fragment) -> bool:
        """Take a fragment: into the algorithm's buffer now, unless its policy lag is over the bound.

        Without back-pressure it waits in an unbounded backlog instead, and its lag is measured
        when it leaves the backlog for the buffer, just before it is trained on.
        """
        if not self.backpressure:
            self.backlog.append(fragment)
            return True
        return self._admit(fragment)

    def _admit(self, fragment: Fragment) -> bool:
        if not self.lag.admit(self.version, fragment.policy_version):
            return False
        start = time.perf_counter()
        if self.algo.ready():  # the replay ratio counts from the end of the warm-up
            self.limiter.inserted(fragment.env_steps)
        self.algo.add(fragment.arrays)
        self.fragments_consumed += 1
        self.env_steps_consumed += fragment.env_steps
        if self._version_at_last_admit is not None:
            step = self.version - self._version_at_last_admit
            self.versions_per_fragment += VERSIONS_EMA * (step - self.versions_per_fragment)
        self._version_at_last_admit = self.version
        self.busy_s += time.perf_counter() - start
        return True

    def wants_data(self) -> bool:
        """Take another fragment now? (The buffer has room and the rate limiter lets actors go on.)"""
        if not self.backpressure:
            return True
        if not self.algo.wants_data():
            return False
        return not self.algo.ready() or self.limiter.can_insert()

    def ready(self) -> bool:
        """Train now? (Enough data, and the rate limiter lets the learner go on.)"""
        if not self.backpressure:
            while self.backlog and self.algo.wants_data():
                self._admit(self.backlog.popleft())
            return self.algo.ready()
        return self.algo.ready() and self.limiter.can_sample(self.algo.samples_per_update())

    def update(self) -> dict[str, float]:
        """One update (raises tianji.runtime.sync.GroupStopping when the learner group is stopping)."""
        start = time.perf_counter()
        self.algo.env_steps = self.env_steps_consumed * self.group_size  # for the algorithm's schedules
        if self.own_random is None:
            self.last_stats = self.algo.update()
        else:
            with self.own_random.drawing():
                self.last_stats = self.algo.update()
        if self.sync is not None:
            self.sync.after_update(self.algo.parameters(), self.algo.optimizer_moments())
        self.version += 1
        self.updates += 1
        self.samples_trained += self.algo.samples_per_update()
        self.limiter.trained(self.algo.samples_per_update())
        self.busy_s += time.perf_counter() - start
        return self.last_stats

    def weights(self) -> Arrays:
        return self.algo.weights()

    def attach_sync(self, sync: NoSync) -> None:
        self.sync = sync
        self.algo.sync = sync
        self.group_size = sync.world_size

    def poll_sync(self) -> None:
        """Apply a parameter average that completed while the learner was waiting for data."""
        if self.sync is not None:
            self.sync.poll(self.algo.parameters(), self.algo.optimizer_moments())

    def stop_sync(self) -> None:
        """Leave the learner group in step with the others (stopping is a collective)."""
        if self.sync is not None:
            self.sync.stop(self.algo.parameters(), self.algo.optimizer_moments())

    def state_dict(self) -> dict[str, Any]:
        sync = (
            {}
            if self.sync is None
            else {"sync": {"averages": self.sync.averages, "own_progress": self.sync.own_progress()}}
        )
        return {
            "algo": self.algo.state_dict(),
            "version": self.version,
            "updates": self.updates,
            "samples_trained": self.samples_trained,
            "env_steps_consumed": self.env_steps_consumed,
            **sync,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.algo.load_state_dict(state["algo"])
        self.version = int(state["version"])
        self.updates = int(state["updates"])
        self.samples_trained = int(state["samples_trained"])
        self.env_steps_consumed = int(state.get("env_steps_consumed", 0))  # absent before schedules existed
