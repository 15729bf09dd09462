"""Staleness as data: policy-lag accounting, the bound that drops stale fragments, lag-aware credits,
and the rate limiter of off-policy training."""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class LagStats:
    """Lag (learner version - fragment version) of every fragment, trained on or dropped as too stale."""

    max_policy_lag: int
    trained: Counter = field(default_factory=Counter)  # lag -> fragments trained on
    dropped_lags: Counter = field(default_factory=Counter)  # lag -> fragments dropped
    # windows since the last `take_window()`, for live metrics
    _window: list[int] = field(default_factory=list)
    _dropped_window: list[int] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_lags.values())

    def admit(self, learner_version: int, fragment_version: int) -> bool:
        """Record the lag; False when the fragment is over the bound and must be dropped."""
        lag = max(0, learner_version - fragment_version)
        if lag > self.max_policy_lag:
            self.dropped_lags[lag] += 1
            self._dropped_window.append(lag)
            return False
        self.trained[lag] += 1
        self._window.append(lag)
        return True

    def take_window(self) -> tuple[list[int], list[int]]:
        """Lags of the fragments trained on and dropped since the last call."""
        window, dropped = self._window, self._dropped_window
        self._window, self._dropped_window = [], []
        return window, dropped

    def summary(self) -> dict[str, float]:
        return lag_summary(self.trained)


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


@dataclass
class _ActorSlots:
    identity: bytes
    held: deque  # slots the learner holds: free, not granted yet
    granted: set = field(default_factory=set)  # slots granted; their fragment has not arrived
    last_grant: int = -1


class CreditLedger:
    """Lag-aware credits: which shared-memory slots each actor may fill, and with weights how new.

    An actor's slots all start with the learner (on its hello), which grants them one at a time.
    A fragment started now is trained on after the fragments already in flight (granted, not yet
    received), each worth `versions_per_fragment` learner versions, so its expected lag is

        lag = in_flight * versions_per_fragment + (learner version - version the actor starts with)

    A slot is granted only while in_flight * versions_per_fragment <= max_policy_lag, with
    `min_version` = version + in_flight * versions_per_fragment - max_policy_lag (at most the current
    version, which the actor can always get: no deadlock); the actor waits for weights that new
    before it starts the fragment. So actors never produce data destined to be dropped, and when
    the bound is loose (or `lag_aware` is off) every slot is granted at once, as plain credits.

        ledger = CreditLedger(max_policy_lag=2)
        ledger.register(actor_id=0, identity=b"a0", slots=2)
        ledger.grant(version=0, versions_per_fragment=1.0)   # [(b"a0", 0, 0), (b"a0", 1, 0)]
        ledger.receive(b"a0", 0)                             # True: the notice may be read, slot 0 is held again
    """

    def __init__(self, max_policy_lag: float, lag_aware: bool = True):
        self.max_policy_lag = max_policy_lag
        self.lag_aware = lag_aware
        self.actors: dict[int, _ActorSlots] = {}
        self._by_identity: dict[bytes, _ActorSlots] = {}
        self._grants = 0

    def register(self, actor_id: int, identity: bytes, slots: int) -> None:
        """An actor said hello: the learner holds all its slots. A restarted actor (same id, new
        identity) replaces its predecessor, whose grants are forgotten."""
        if identity in self._by_identity:
            return  # a repeated hello
        old = self.actors.get(actor_id)
        if old is not None:
            del self._by_identity[old.identity]
        self.actors[actor_id] = self._by_identity[identity] = _ActorSlots(identity, deque(range(slots)))

    def in_flight(self) -> int:
        return sum(len(a.granted) for a in self.actors.values())

    def receive(self, identity: bytes, slot: object) -> bool:
        """A fragment notice arrived. True when `slot` was granted to this actor: the slot is held by
        the learner again (read it before the next `grant`). False: not ours to read (unknown or
        replaced actor, or a slot never granted)."""
        actor = self._by_identity.get(identity)
        if actor is None or slot not in actor.granted:
            return False
        actor.granted.discard(slot)
        actor.held.append(slot)
        return True

    def grant(self, version: int, versions_per_fragment: float) -> list[tuple[bytes, int, int]]:
        """Slots to grant now, as (identity, slot, min_version); fewest-in-flight actors first."""
        grants = []
        while True:
            waiting = [a for a in self.actors.values() if a.held]
            if not waiting:
                return grants
            in_flight = self.in_flight()
            expected_lag = in_flight * versions_per_fragment
            if self.lag_aware and in_flight > 0 and expected_lag > self.max_policy_lag:
                return grants
            actor = min(waiting, key=lambda a: (len(a.granted), a.last_grant))
            slot = actor.held.popleft()
            actor.granted.add(slot)
            self._grants += 1
            actor.last_grant = self._grants
            room = math.ceil(version + expected_lag - self.max_policy_lag - 1e-9) if self.lag_aware else 0
            grants.append((actor.identity, slot, max(0, min(version, room))))


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
