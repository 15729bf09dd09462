"""The learner's half of the protocol, with no sockets: every launcher drives this one object.

Inline steps it by calls; the local and Ray launchers' learner loop (`loops.learner_loop`) feeds
it the messages its sockets receive and sends what it returns. So all three run the same
credits, lag bound, rate limiter, slot lifetimes, publishing, group sync and checkpoint timing.

    service = LearnerService(learner, cfg, epoch=0)
    service.hello(peer, Hello(actor=0, slots=2))      # -> the weights to reply with
    for peer, slot, min_version in service.grants(): ...  # credits to send
    if service.notice(peer, notice):                  # a FragmentNotice for a granted slot
        service.take(peer, notice.slot, fragment, in_slot=True)
    published = service.step()          # one update when ready; new weights to publish, or None
    if service.checkpoint_due(): save(service.learner.state_dict())
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from tianji.config import Config
from tianji.runtime.balance import CreditLedger, FixedSchedule, LagController, LagDecision, LagWindow
from tianji.runtime.roles.actor import Fragment
from tianji.runtime.roles.learner import Learner
from tianji.runtime.roles.reporters import LearnerReporter
from tianji.runtime.shared.protocol import FragmentNotice, Hello
from tianji.runtime.transport.wire import WireError

EVENT_INTERVAL_S = 0.1
# the lag controller's window (balance.max_policy_lag: auto): 2 s or 4 updates, whichever ends first (a
# CartPole run lasts a few seconds at ~15 updates/s; a Pong update takes about a second); it decides on 3
LAG_WINDOW_S = 2.0
LAG_WINDOW_UPDATES = 4

log = logging.getLogger(__name__)


PeerT = TypeVar("PeerT", bound=Hashable)  # how the transport names a sender: a ZeroMQ identity, an actor id
NO_DROPS = 2**62  # the lag bound under a deterministic schedule, which fixes every fragment's age itself


def learner_of(cfg: Config, actor_id: int) -> int:
    """The learner an actor feeds: actors are dealt to learners in turn (evenly)."""
    return actor_id % cfg.topology.learner_count


def fixed_schedule(cfg: Config, rank: int) -> FixedSchedule:
    """balance.schedule deterministic for learner `rank`: its actors, how far ahead they run, and with
    stop.max_env_steps its share of the fragments (the run ends at the same weights every time)."""
    actors = [i for i in range(cfg.topology.actor_count) if learner_of(cfg, i) == rank]
    budget = None
    if cfg.stop.max_env_steps is not None:
        fragment_steps = cfg.topology.fragment_length * cfg.topology.envs_count
        budget = math.ceil(math.ceil(cfg.stop.max_env_steps / fragment_steps) / cfg.topology.learner_count)
    return FixedSchedule(actors, int(cfg.balance.max_policy_lag), budget)


class Grant(NamedTuple):
    """A credit to send: `peer` may fill `slot` from weights `min_version` or newer; under a deterministic
    schedule exactly those, which come with it (`weights`)."""

    peer: Any
    slot: int
    min_version: int
    weights: Any = None


class LearnerService(Generic[PeerT]):
    """Hello, notices, lag-aware grants, slot lifetimes, publishing, group sync, event and checkpoint
    timing around one `Learner`. A peer is whatever the transport names a sender by (a ZeroMQ
    identity, an actor id inline)."""

    def __init__(
        self, learner: Learner, cfg: Config, epoch: int = 0, rank: int = 0, clock: Callable[[], float] = time.time
    ):
        self.learner = learner
        self.epoch = epoch
        self.publish_every = cfg.balance.publish_every
        self.default_slots = cfg.balance.slots_per_actor
        self.checkpoint_interval_s = cfg.checkpoint.interval_s
        bound = cfg.balance.bound_at_start
        self.lag_control = LagController(bound, max_inflight=self.default_slots) if cfg.balance.lag_is_auto else None
        cap = None if self.lag_control is None else self.lag_control.inflight
        self.credits = CreditLedger(bound, lag_aware=cfg.balance.backpressure, inflight_cap=cap)
        self.reporter = LearnerReporter(learner, rank, self.credits, self.default_slots)
        self.schedule: FixedSchedule | None = None
        if cfg.balance.deterministic:
            self._follow_schedule(fixed_schedule(cfg, rank), epoch)
        # Without back-pressure fragments wait in a backlog, so they must be copied out of their slot;
        # with it, a slot goes back to its actor once the algorithm has copied what it keeps (replay)
        # or once the update that trains on it returns (on-policy: the algorithm holds fragments).
        self.trains_in_slot = cfg.balance.backpressure
        self._holds = bool(getattr(learner.algo, "holds_fragments", False))
        self._trained_in_slot: list[tuple[PeerT, int]] = []
        self._newest_seq: dict[tuple[PeerT, int], int] = {}  # (actor's link, actor) -> newest fragment taken
        self.published = learner.version
        self.published_weights = learner.weights()
        # balance.publish_delay: the weights of the last updates, the oldest published (a diagnosis of data age)
        self._delayed: deque[Any] = deque(maxlen=cfg.balance.publish_delay + 1)
        self._delay_draws = np.random.default_rng(cfg.seed) if cfg.balance.publish_delay_varies else None
        self.clock = clock
        self._last_event = self._last_checkpoint = clock()
        # the lag controller's window: from the first update on (the wait for the first data is no signal)
        self._window_start: float | None = None
        self._window_wait_s = 0.0  # the reporter's wait_s when the window began
        self._window_ess: list[float] = []
        self._window_updates = 0
        self._checkpointed_version = learner.version  # a resumed learner's is on disk already
        if self.schedule is not None:
            self.schedule.start(learner.version, self.published_weights)

    def _follow_schedule(self, schedule: FixedSchedule, epoch: int) -> None:
        if epoch > 0:
            log.warning("balance.schedule deterministic: a restarted learner goes on with the free schedule")
            return
        self.schedule = schedule
        self.credits.lag_aware = False  # the schedule says which weights each fragment starts from
        self._free_bound = self.learner.lag.max_policy_lag
        self.learner.lag.max_policy_lag = NO_DROPS
        self.reporter.schedule = "deterministic"

    def give_up_schedule(self, reason: str) -> None:
        """Go on with the free schedule: what waits for its turn is trained now, in order."""
        if self.schedule is None:
            return
        log.warning("balance.schedule deterministic given up (%s): the run goes on with the free schedule", reason)
        waiting, self.schedule = self.schedule.drain(), None
        self.credits.lag_aware = True
        self.learner.lag.max_policy_lag = self._free_bound
        self.reporter.schedule, self.reporter.schedule_done = "free", False
        for peer, slot, fragment, in_slot in waiting:
            self._take_now(peer, slot, fragment, in_slot)

    # ------------------------------------------------------------ messages in

    def hello(self, peer: PeerT, hello: Hello) -> tuple[int, Any]:
        """An actor (or the evaluator) said hello: an actor's slots are the learner's to grant.
        Returns the weights to reply with: (version, arrays)."""
        if hello.actor is not None:  # the evaluator says hello too, but fills no slots
            known = self.credits.actors.get(hello.actor)
            if known is not None and known.identity != peer:
                self.give_up_schedule(f"actor{hello.actor} was restarted")
            self.credits.register(hello.actor, peer, hello.slots or self.default_slots)
            if hello.resync is not None:  # its link came back after a cut
                self.give_up_schedule(f"actor{hello.actor}'s link was cut")
                self.credits.resync(peer, set(hello.resync.sent))
        return self.published, self.published_weights

    def notice(self, peer: PeerT, notice: FragmentNotice) -> bool:
        """A fragment notice came: True when its arrays are to be read and taken; False when it is for
        an earlier learner incarnation (its slot was granted anew). Raises WireError for a slot that
        was not granted to its sender."""
        if notice.epoch != self.epoch:
            self.reporter.stale_notices += 1
            return False
        if not self.credits.arrived(peer, notice.slot):
            raise WireError(f"fragment notice for slot {notice.slot!r}, which was not granted to its sender")
        return True

    def take(self, peer: PeerT, slot: int, fragment: Fragment, in_slot: bool) -> None:
        """Hand the learner a noticed fragment. `in_slot`: its arrays are views of the sender's slot,
        which then stays the learner's until the update that trains on it returns. Under a deterministic
        schedule it waits for its turn. A fragment the same actor delivered before is refused and counted:
        an actor numbers its fragments in order, and none is trained twice."""
        if fragment.seq <= self._newest_seq.get((peer, fragment.actor_id), -1):
            self.reporter.fragments_repeated += 1
            self.credits.release(peer, slot)
            return
        self._newest_seq[peer, fragment.actor_id] = fragment.seq
        if self.schedule is None:
            self._take_now(peer, slot, fragment, in_slot)
            return
        self.schedule.arrived(fragment.actor_id, fragment.seq, (peer, slot, fragment, in_slot))
        self._take_in_turn(self.schedule)

    def _take_in_turn(self, schedule: FixedSchedule) -> None:
        """The fragments whose turn it is, each once the updates the one before made ready are done."""
        while not self.learner.ready() and (item := schedule.next_to_take()) is not None:
            self._take_now(*item)
            if not self.learner.ready():
                schedule.trained(self.learner.version, self.learner.weights())
        self.reporter.schedule_done = schedule.finished

    def _take_now(self, peer: PeerT, slot: int, fragment: Fragment, in_slot: bool) -> None:
        if self.learner.consume(fragment) and self._holds and in_slot and self.trains_in_slot:
            self._trained_in_slot.append((peer, slot))
        else:
            self.credits.release(peer, slot)

    def give_back(self, peer: PeerT, slot: object) -> None:
        """A malformed notice named `slot`: if it was granted to this sender, the slot is the learner's again."""
        if self.credits.arrived(peer, slot):
            self.credits.release(peer, slot)  # type: ignore[arg-type]  # arrived only for an int slot

    def reject(self, peer: PeerT, slot: int) -> None:
        """A noticed fragment could not be read: its slot is the learner's again."""
        self.credits.release(peer, slot)

    # ------------------------------------------------------------ work

    def wants_data(self) -> bool:
        return self.schedule is not None or self.learner.wants_data()  # a schedule holds early fragments

    def ready(self) -> bool:
        return self.learner.ready()

    def step(self) -> tuple[int, Any] | None:
        """Train once if the balance rules allow; returns new weights to publish (version, arrays) or
        None. Raises tianji.runtime.sync.GroupStopping when another learner of the group stops."""
        if self.schedule is not None:
            self._take_in_turn(self.schedule)
        if not self.learner.ready():
            self.learner.poll_sync()
            return None
        self.learner.update()
        if self.schedule is not None:  # the run's curve, version by version (versions.jsonl)
            self.reporter.version_stats.append((self.learner.version, dict(self.learner.last_stats)))
        if self.lag_control is not None:
            self._control_lag(self.lag_control)
        for peer, slot in self._trained_in_slot:
            self.credits.release(peer, slot)
        self._trained_in_slot.clear()
        weights = None
        if self.schedule is not None and not self.learner.ready():  # the fragment's updates are done
            weights = self.learner.weights()
            self.schedule.trained(self.learner.version, weights)
            self._take_in_turn(self.schedule)  # after the release: the next one's slot stays held
        if self.learner.version % self.publish_every:
            return None
        self._delayed.append(weights if weights is not None else self.learner.weights())
        # index 0 is the oldest kept (publish_delay updates ago); publish_delay_varies draws the age instead
        pick = 0 if self._delay_draws is None else int(self._delay_draws.integers(len(self._delayed)))
        self.published, self.published_weights = self.learner.version, self._delayed[pick]
        return self.published, self.published_weights

    def _control_lag(self, control: LagController) -> None:
        """Feed the controller a window (the learner's share of time waiting, the updates' mean effective
        sample size) every LAG_WINDOW_S or LAG_WINDOW_UPDATES; apply its decision to the bound and the
        credits."""
        now = self.clock()
        if self._window_start is None:  # the first update: the window starts here
            self._open_lag_window(now)
            return
        ess = self.learner.last_stats.get("rho_ess")
        if ess is not None:
            self._window_ess.append(float(ess))
        self._window_updates += 1
        if now - self._window_start < LAG_WINDOW_S and self._window_updates < LAG_WINDOW_UPDATES:
            return
        waited = (self.reporter.wait_s - self._window_wait_s) / max(now - self._window_start, 1e-9)
        ess_mean = sum(self._window_ess) / len(self._window_ess) if self._window_ess else float("nan")
        self._open_lag_window(now)
        decision = control.observe(LagWindow(min(waited, 1.0), ess_mean))
        if decision is not None:
            self.apply_lag(decision)

    def _open_lag_window(self, now: float) -> None:
        self._window_start, self._window_wait_s = now, self.reporter.wait_s
        self._window_ess, self._window_updates = [], 0

    def apply_lag(self, decision: LagDecision) -> None:
        self.credits.max_policy_lag = self.learner.lag.max_policy_lag = decision.bound
        self.credits.inflight_cap = decision.inflight
        log.info("lag bound %d, %d credit(s) per actor: %s", decision.bound, decision.inflight, decision.reason)

    def grants(self) -> list[Grant]:
        """Credits to send now."""
        if self.schedule is not None:
            return self._scheduled_grants(self.schedule)
        lr = self.learner
        return [Grant(*g) for g in self.credits.grant(lr.version, lr.versions_per_fragment, self.published)]

    def _scheduled_grants(self, schedule: FixedSchedule) -> list[Grant]:
        grants = []
        for actor_id in schedule.position:
            while self.credits.has_free_slot(actor_id) and (turn := schedule.next_grant(actor_id)) is not None:
                _, version, weights = turn
                peer, slot = self.credits.grant_slot(actor_id, version)
                grants.append(Grant(peer, slot, version, weights))
        return grants

    def stop(self) -> None:
        """Leave the learner group in step with the others (with a group, stopping is a collective)."""
        self.learner.stop_sync()

    # ------------------------------------------------------------ timing

    def event_due(self) -> bool:
        return self._due("_last_event", EVENT_INTERVAL_S)

    def checkpoint_due(self) -> bool:
        """A periodic checkpoint is due (not when the learner has not trained since the last one)."""
        if self.learner.version == self._checkpointed_version or not self._due(
            "_last_checkpoint", self.checkpoint_interval_s
        ):
            return False
        self._checkpointed_version = self.learner.version
        return True

    def _due(self, last: str, interval_s: float) -> bool:
        now = self.clock()
        if now - getattr(self, last) < interval_s:
            return False
        setattr(self, last, now)
        return True
