"""Staleness as data: policy-lag accounting, the bound that drops stale fragments, lag-aware credits,
and the rate limiter of off-policy training."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LagStats:
    """Lag (learner version - fragment version) of every fragment, trained on or dropped as too stale."""

    max_policy_lag: int
    trained: Counter[int] = field(default_factory=Counter)  # lag -> fragments trained on
    dropped_lags: Counter[int] = field(default_factory=Counter)  # lag -> fragments dropped
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


def lag_summary(histogram: Counter[int]) -> dict[str, float]:
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
    identity: Hashable
    held: deque[int]  # slots the learner holds: free, not granted yet
    floors: dict[int, int] = field(default_factory=dict)  # granted slot -> min_version: starts from no older
    arrived: set[int] = field(default_factory=set)  # granted slots whose notice is waiting at the learner
    last_grant: int = -1


class CreditLedger:
    """Lag-aware credits: which shared-memory slots each actor may fill, and with weights how new.

    An actor's slots all start with the learner (on its hello), which grants them one at a time.
    Every fragment in flight (granted, not yet trained on) may be trained on after all the others,
    each worth `versions_per_fragment` learner versions: fast fragments overtake slow ones. A grant
    asks the actor to start from the newest published weights (its `min_version`, its floor), so
    granting one more with n in flight is safe while, for the new fragment and every one in flight,

        version + n * versions_per_fragment - floor <= max_policy_lag

    The actor waits for weights that new before it starts, and can always get them (no deadlock).
    So actors do not produce data destined to be dropped; when the bound is loose (or `lag_aware`
    is off) every slot is granted at once, as plain credits.

        ledger = CreditLedger(max_policy_lag=2)
        ledger.register(actor_id=0, identity=b"a0", slots=2)
        ledger.grant(version=0, versions_per_fragment=1.0)   # [(b"a0", 0, 0), (b"a0", 1, 0)]
        ledger.arrived(b"a0", 0)                             # True: its notice is valid, read it
        ledger.release(b"a0", 0)                             # read: the learner holds slot 0 again
    """

    def __init__(self, max_policy_lag: float, lag_aware: bool = True, inflight_cap: int | None = None):
        self.max_policy_lag = max_policy_lag
        self.lag_aware = lag_aware
        self.inflight_cap = inflight_cap  # grants in flight per actor, below its slots (the lag controller's)
        self.actors: dict[int, _ActorSlots] = {}
        self._by_identity: dict[Hashable, _ActorSlots] = {}
        self.granted = 0  # grants made, cumulative
        self.resyncs = 0  # links that came back after a cut and said what they hold (cumulative)
        self.fragments_lost = 0  # fragments sent on a link that was cut and never arrived
        self.credits_voided = 0  # grants an actor never held or used because its link was cut

    def register(self, actor_id: int, identity: Hashable, slots: int) -> None:
        """An actor said hello: the learner holds all its slots. A restarted actor (same id, new
        identity) replaces its predecessor, whose grants are forgotten."""
        if identity in self._by_identity:
            return  # a repeated hello
        old = self.actors.get(actor_id)
        if old is not None:
            del self._by_identity[old.identity]
        self.actors[actor_id] = self._by_identity[identity] = _ActorSlots(identity, deque(range(slots)))

    def resync(self, identity: Hashable, sent: set[int]) -> None:
        """A link came back after a cut: its actor sent the fragments in `sent`, which no credit has answered
        (and drops the credits it holds). Every grant of the actor whose fragment has not arrived is voided
        and its slot is the learner's again (ZeroMQ delivers in order, so what was sent before this hello and
        has not arrived never will): those named in `sent` are fragments lost on the way, the rest credits
        the actor never got or gave up. The actor counts its credits void too, until the reply."""
        actor = self._by_identity.get(identity)
        if actor is None:
            return
        self.resyncs += 1
        for slot in [s for s in actor.floors if s not in actor.arrived]:
            if slot in sent:
                self.fragments_lost += 1
            else:
                self.credits_voided += 1
            del actor.floors[slot]
            actor.held.append(slot)

    def in_flight(self) -> int:
        return sum(len(a.floors) for a in self.actors.values())

    def _granted(self, identity: Hashable, slot: object) -> _ActorSlots | None:
        actor = self._by_identity.get(identity)
        return actor if actor is not None and slot in actor.floors else None

    def arrived(self, identity: Hashable, slot: object) -> bool:
        """A fragment notice came. True when `slot` was granted to this sender and not noticed yet;
        False: not ours to read (unknown or replaced actor, a slot never granted, a repeat)."""
        actor = self._granted(identity, slot)
        if actor is None or not isinstance(slot, int) or slot in actor.arrived:
            return False
        actor.arrived.add(slot)
        return True

    def release(self, identity: Hashable, slot: int) -> None:
        """The learner has read (or dropped) the fragment in `slot`: it holds the slot again."""
        actor = self._granted(identity, slot)
        if actor is not None and slot in actor.arrived:
            del actor.floors[slot]
            actor.arrived.discard(slot)
            actor.held.append(slot)

    def has_free_slot(self, actor_id: int) -> bool:
        actor = self.actors.get(actor_id)
        return actor is not None and bool(actor.held)

    def grant_slot(self, actor_id: int, min_version: int) -> tuple[Hashable, int]:
        """Grant one of `actor_id`'s free slots (`has_free_slot`) to start from `min_version`: (identity, slot)."""
        actor = self.actors[actor_id]
        slot = actor.held.popleft()
        actor.floors[slot] = min_version
        self.granted += 1
        actor.last_grant = self.granted
        return actor.identity, slot

    def grant(
        self, version: int, versions_per_fragment: float, published: int | None = None
    ) -> list[tuple[Hashable, int, int]]:
        """Slots to grant now, as (identity, slot, min_version); fewest-in-flight actors first.
        `published`: the newest weights actors can get (default `version`); a grant asks for them."""
        published = version if published is None else published
        grants: list[tuple[Hashable, int, int]] = []
        while True:
            cap = self.inflight_cap
            waiting = [a for a in self.actors.values() if a.held and (cap is None or len(a.floors) < cap)]
            if not waiting:
                return grants
            floors = [f for a in self.actors.values() for f in a.floors.values()]
            needed = version + len(floors) * versions_per_fragment - self.max_policy_lag
            if self.lag_aware and needed > min([published, *floors]) + 1e-9:
                return grants
            actor = min(waiting, key=lambda a: (len(a.floors), a.last_grant))
            slot = actor.held.popleft()
            min_version = published if self.lag_aware else 0
            actor.floors[slot] = min_version
            self.granted += 1
            actor.last_grant = self.granted
            grants.append((actor.identity, slot, min_version))


class FixedSchedule:
    """balance.schedule deterministic: which fragment the learner trains next, and which weights each
    fragment starts from, fixed by the seed and the layout instead of by timing.

    A learner's A actors make fragments numbered n = k x A + i (actor i's k-th, i counted among this
    learner's actors). The learner takes them in that order, and takes fragment n + 1 only once the
    updates fragment n made ready are done. Fragment n starts from the weights the learner had after
    the updates of fragment n - ahead - 1 (the start's weights for the first ahead + 1): up to ahead + 1
    fragments are made while the learner trains, and each is exactly as old as the schedule says.

        schedule = FixedSchedule(actor_ids=[0, 1], ahead=4, budget=None)
        schedule.start(version, weights)                  # what fragments 0 .. ahead start from
        schedule.next_grant(actor_id)                     # (n, version, weights) for its next fragment, or None
        schedule.arrived(actor_id, seq, item)             # a fragment came (in any order)
        item = schedule.next_to_take()                    # the next in order, once the last one's updates are done
        schedule.trained(version, weights)                # the updates of the fragment taken last are done
    """

    def __init__(self, actor_ids: list[int], ahead: int, budget: int | None = None):
        self.position = {actor: i for i, actor in enumerate(sorted(actor_ids))}
        self.ahead = ahead
        self.budget = budget  # fragments this learner trains in all (stop.max_env_steps), None: no end
        self.taken = 0  # fragments taken for training, in order: the next one's number
        self.done = 0  # fragments whose updates are done
        self.starts: dict[int, tuple[int, Any]] = {}  # m -> (version, weights) after fragment m's updates
        self.granted = dict.fromkeys(self.position, 0)  # per actor: its next fragment's k
        self.waiting: dict[int, Any] = {}  # fragments that came before their turn, by number

    def number(self, actor_id: int, seq: int) -> int:
        return seq * len(self.position) + self.position[actor_id]

    def start(self, version: int, weights: Any) -> None:
        self.starts[-1] = (version, weights)

    def next_grant(self, actor_id: int) -> tuple[int, int, Any] | None:
        """The number of `actor_id`'s next fragment, the version and the weights it starts from; None while
        the learner has not trained that far (or the budget is spent)."""
        n = self.number(actor_id, self.granted[actor_id])
        m = n - self.ahead - 1
        if (self.budget is not None and n >= self.budget) or m >= self.done:
            return None
        version, weights = self.starts[max(m, -1)]
        if m >= 0:
            del self.starts[m]  # exactly one fragment starts from each fragment's weights
        self.granted[actor_id] += 1
        return n, version, weights

    def arrived(self, actor_id: int, seq: int, item: Any) -> None:
        self.waiting[self.number(actor_id, seq)] = item

    def next_to_take(self) -> Any | None:
        if self.done < self.taken or self.taken not in self.waiting:
            return None
        self.taken += 1
        return self.waiting.pop(self.taken - 1)

    def trained(self, version: int, weights: Any) -> None:
        """The updates of the fragment taken last are done: the weights of fragment taken + ahead."""
        if self.done < self.taken:
            self.starts[self.done] = (version, weights)
            self.done += 1

    @property
    def finished(self) -> bool:
        return self.budget is not None and self.done >= self.budget

    def drain(self) -> list[Any]:
        """Every fragment still waiting, in order (the schedule is being given up)."""
        items = [self.waiting[n] for n in sorted(self.waiting)]
        self.waiting.clear()
        return items


def lag_aware_in_flight(max_policy_lag: float, versions_per_fragment: float) -> int:
    """The fragments the `CreditLedger` keeps in flight, on average, while the learner is the bottleneck
    (the planner's model of it; a test holds the two equal). Grants come in bursts: every fragment in
    flight may be trained after all the others, so the ledger grants up to bound / versions_per_fragment
    + 1 from the newest weights, then none until they drain, one fragment's versions at a time: a sawtooth
    whose mean is about half of that, bound / (2 versions_per_fragment) + 1."""
    return int(max_policy_lag // (2 * max(versions_per_fragment, 1e-9))) + 1


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

    def __init__(self, target: float | None, tolerance: float, clock: Callable[[], float] = time.perf_counter):
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
        allowed = (
            self.target is None
            or self.samples_trained + samples <= self.high * self.steps_inserted
            or self.samples_trained < self.low * self.steps_inserted
        )
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


# ---------------------------------------------------------------- the lag bound, chosen online


@dataclass(frozen=True)
class LagWindow:
    """What one window of training measured: the lag controller's inputs.

    `learner_wait`: of the window's wall time, the share the learner waited for data (production short).
    `ess`: the effective sample size of the importance weights pi / mu of the data trained on, over their
    count, (sum w)^2 / (n sum w^2): 1 when the data are as good as fresh, lower as the actors' policy and
    the learner's drift apart (`train/rho_ess`); NaN where the algorithm does not measure it. A share of
    truncated weights is no such signal: with V-trace's rho_bar of 1 about half the weights of fresh data
    are over it (measured on BeamRider: 37-49 % at lag 0-4)."""

    learner_wait: float
    ess: float = float("nan")


@dataclass(frozen=True)
class LagDecision:
    """One move of the bound (and the credits with it), and why."""

    bound: int
    inflight: int
    reason: str


@dataclass
class LagController:
    """`balance.max_policy_lag: auto`: raises the lag bound while the learner waits for data and stale data
    still teach (the weights' effective sample size high); lowers it when they stop teaching.

    Each decision reads the means of the last `patience` windows, all measured under the current bound (the
    history starts again after every move). Until the bound is first lowered a raise doubles it (a start
    far too tight costs a short run most of its time: CartPole from bound 1 reaches 8 in 3 decisions, not
    7); after that every move is one version. A dead band between the
    effective sample size that raises and the one that lowers keeps a steady run still rather than
    oscillating, and a bound that was lowered for its data is not raised back to for `ceiling_windows`
    windows (on a recorded trace whose data stop teaching now and then, the bound went 8, 7, 6, 7, 6
    without it). Without an effective sample size it never raises. The credits per actor follow the
    bound: the lag-aware ledger keeps about bound / 2 + 1 fragments in flight (`lag_aware_in_flight`).

        control = LagController(bound=2)
        control.observe(LagWindow(learner_wait=0.3, ess=0.97))  # None: 1 window of the 3 a decision reads
    """

    bound: int
    low: int = 1
    high: int = 16
    max_inflight: int = 4
    wait_to_raise: float = 0.10  # the learner waited more than this share of the time
    ess_to_raise: float = 0.90  # and the data kept at least this effective sample size
    ess_to_lower: float = 0.75  # below this, stale data stopped teaching
    patience: int = 3
    ceiling_windows: int = 30  # how long a bound that was lowered for its data stays out of reach
    decisions: list[LagDecision] = field(default_factory=list)
    _history: list[LagWindow] = field(default_factory=list)
    _ceiling: int | None = None
    _ceiling_left: int = 0
    _lowered: bool = False  # once lowered, raises go one version at a time

    def __post_init__(self) -> None:
        self.bound = min(max(self.bound, self.low), self.high)

    @property
    def inflight(self) -> int:
        return min(self.bound // 2 + 1, self.max_inflight)

    def observe(self, window: LagWindow) -> LagDecision | None:
        """Take one window's measurements; returns the decision when the bound moved, else None."""
        self._history = [*self._history, window][-self.patience :]
        self._ceiling_left -= 1
        if self._ceiling_left <= 0:
            self._ceiling = None
        if len(self._history) < self.patience:
            return None
        step, reason = self._step()
        if step > 0 and not self._lowered:
            step = self.bound  # doubling
        bound = min(max(self.bound + step, self.low), self.high if self._ceiling is None else self._ceiling)
        if bound == self.bound:
            return None
        if bound < self.bound:
            self._ceiling, self._ceiling_left, self._lowered = bound, self.ceiling_windows, True
        self.bound = bound
        self._history = []  # what the old bound measured does not judge the new one
        decision = LagDecision(bound, self.inflight, reason)
        self.decisions.append(decision)
        return decision

    def _step(self) -> tuple[int, str]:
        """-1 (lower), +1 (raise) or 0 (hold), with why, from the means of the history."""
        wait = sum(w.learner_wait for w in self._history) / len(self._history)
        ess = sum(w.ess for w in self._history) / len(self._history)  # NaN if one is
        if ess < self.ess_to_lower:  # False for NaN
            return -1, f"stale data stopped teaching (effective sample size {ess:.2f})"
        if wait > self.wait_to_raise and ess >= self.ess_to_raise:
            return 1, f"the learner waited {wait:.0%} of the time, stale data still teach (ess {ess:.2f})"
        return 0, "steady"
