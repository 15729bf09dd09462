"""Staleness as data: policy-lag accounting and the bound that drops stale fragments."""

from __future__ import annotations

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
        count = sum(self.histogram.values())
        if not count:
            return {"policy_lag_min": 0, "policy_lag_mean": 0.0, "policy_lag_max": 0}
        total = sum(lag * n for lag, n in self.histogram.items())
        return {
            "policy_lag_min": min(self.histogram),
            "policy_lag_mean": total / count,
            "policy_lag_max": max(self.histogram),
        }
