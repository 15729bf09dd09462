"""Staleness as data: policy-lag accounting and the bound that drops stale fragments."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LagStats:
    """Lag (learner version - fragment version) of every fragment seen, consumed or dropped."""

    max_policy_lag: int
    histogram: Counter = field(default_factory=Counter)
    dropped: int = 0
    # window since the last `take_window()`, for live metrics
    _window: list[int] = field(default_factory=list)

    def admit(self, learner_version: int, fragment_version: int) -> bool:
        """Record the lag; False when the fragment is over the bound and must be dropped."""
        lag = max(0, learner_version - fragment_version)
        self.histogram[lag] += 1
        self._window.append(lag)
        if lag > self.max_policy_lag:
            self.dropped += 1
            return False
        return True

    def take_window(self) -> list[int]:
        window, self._window = self._window, []
        return window

    def summary(self) -> dict[str, float]:
        return lag_summary(self.histogram)


def lag_summary(histogram: Counter) -> dict[str, float]:
    """min/mean/max of a lag histogram ({lag: count})."""
    count = sum(histogram.values())
    if not count:
        return {"policy_lag_min": 0, "policy_lag_mean": 0.0, "policy_lag_max": 0}
    return {
        "policy_lag_min": min(histogram),
        "policy_lag_mean": sum(lag * n for lag, n in histogram.items()) / count,
        "policy_lag_max": max(histogram),
    }


class RateLimiter:
    """Holds the replay ratio (samples trained per env step inserted) inside target * (1 +- tolerance).

    The learner asks `can_insert()` before taking a fragment and `can_sample(n)` before an
    update; the side that is ahead waits. Counting starts when training can start (the
    replay warm-up is not part of the ratio). Time each side spent blocked is recorded, so a
    user can see which side is the bottleneck. `target=None` disables the limit.

        limiter = RateLimiter(target=4.0, tolerance=0.1)
        limiter.inserted(512)        # env steps from a fragment
        limiter.can_sample(128)      # True while trained + 128 <= 4.4 * 512
    """

    def __init__(self, target: float | None, tolerance: float, clock=time.perf_counter):
        self.target = target
        self.low = (target or 0.0) * (1 - tolerance)
        self.high = (target or 0.0) * (1 + tolerance)
        self.clock = clock
        self.steps_inserted = 0
        self.samples_trained = 0
        self.blocked_s = {"insert": 0.0, "sample": 0.0}
        self._blocked_since: dict[str, float | None] = {"insert": None, "sample": None}

    def inserted(self, env_steps: int) -> None:
        self.steps_inserted += env_steps

    def trained(self, samples: int) -> None:
        self.samples_trained += samples

    def ratio(self) -> float:
        return self.samples_trained / self.steps_inserted if self.steps_inserted else 0.0

    def can_insert(self) -> bool:
        """False while the learner is behind the lower bound: actors wait for training to catch up."""
        allowed = self.target is None or self.samples_trained >= self.low * self.steps_inserted
        return self._note("insert", allowed)

    def can_sample(self, samples: int) -> bool:
        """False while training would pass the upper bound: the learner waits for data.

        Never blocks both sides: when inserting is blocked, sampling is allowed.
        """
        allowed = (self.target is None
                   or self.samples_trained + samples <= self.high * self.steps_inserted
                   or self.samples_trained < self.low * self.steps_inserted)
        return self._note("sample", allowed)

    def _note(self, side: str, allowed: bool) -> bool:
        now = self.clock()
        since = self._blocked_since[side]
        if allowed and since is not None:
            self.blocked_s[side] += now - since
            self._blocked_since[side] = None
        elif not allowed and since is None:
            self._blocked_since[side] = now
        return allowed
