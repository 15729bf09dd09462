"""What actors and learners report to the driver: deltas of their cumulative counters since the last
event, as the event messages of tianji.runtime.shared.events."""

from __future__ import annotations

from tianji.runtime.balance import CreditLedger
from tianji.runtime.roles.actor import Actor
from tianji.runtime.roles.learner import Learner
from tianji.runtime.shared.events import ActorEvent, LearnerEvent, actor_event, learner_event


class _Deltas:
    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, cumulative: dict[str, float]) -> dict[str, float]:
        out = {k: v - self._last.get(k, 0) for k, v in cumulative.items()}
        self._last = dict(cumulative)
        return out


class ActorReporter:
    def __init__(self, actor: Actor):
        self.actor = actor
        self.wait_s = 0.0
        self.bad_messages = 0
        self._deltas = _Deltas()

    def event(self) -> ActorEvent:
        a = self.actor
        counts = {
            "env_steps": a.seq * a.T * a.k,
            "fragments": a.seq,
            "busy_s": a.busy_s,
            "wait_s": self.wait_s,
            "bad_messages": self.bad_messages,
        }
        episodes, fragments = a.drain_episodes_and_fragments()
        return actor_event(a.actor_id, episodes, self._deltas(counts), fragments)


class LearnerReporter:
    def __init__(self, learner: Learner, rank: int = 0, credits: CreditLedger | None = None, slots: int = 0):
        self.learner = learner
        self.credits = credits
        self.slots = slots  # each actor's, when no cap is below them
        self.rank = rank
        self.wait_s = 0.0
        self.bad_messages = 0
        self.stale_notices = 0  # from an earlier learner incarnation or a replaced actor: ignored
        self.fragments_repeated = 0  # delivered again by the same actor: refused
        self.refused_peers = 0  # TCP handshakes refused: peers without the run's key (cumulative)
        self.fragments_in_frames = 0  # arrays that came over the network rather than through shared memory
        self.schedule = "free"  # balance.schedule in force (the service's)
        self.schedule_done = False
        self.version_stats: list[tuple[int, dict[str, float]]] = []  # deterministic: every update's stats
        self._deltas = _Deltas()
        self._deltas(self._counts())  # a resumed learner starts from its restored counters

    def _counts(self) -> dict[str, float]:
        lr = self.learner
        return {
            "updates": lr.updates,
            "samples_trained": lr.samples_trained,
            "fragments_consumed": lr.fragments_consumed,
            "dropped": lr.lag.dropped,
            "busy_s": lr.busy_s,
            "wait_s": self.wait_s,
            "bad_messages": self.bad_messages,
            "stale_notices": self.stale_notices,
            "fragments_repeated": self.fragments_repeated,
            "refused_peers": self.refused_peers,
            "fragments_in_frames": self.fragments_in_frames,
            "credits_granted": self.credits.granted if self.credits is not None else 0,
            "link_resyncs": self.credits.resyncs if self.credits is not None else 0,
            "fragments_lost": self.credits.fragments_lost if self.credits is not None else 0,
            "credits_voided": self.credits.credits_voided if self.credits is not None else 0,
            "insert_blocked_s": lr.limiter.blocked_s["insert"],
            "sample_blocked_s": lr.limiter.blocked_s["sample"],
        }

    def event(self) -> LearnerEvent:
        lr = self.learner
        trained, dropped = lr.lag.take_window()
        return learner_event(
            self.rank,
            lr.version,
            trained,
            dropped,
            dict(lr.last_stats),
            lr.limiter.ratio(),
            self._deltas(self._counts()),
            lr.lag.max_policy_lag if self.schedule == "free" else float("nan"),
            self._inflight(),
            self.schedule,
            self.schedule_done,
            self._drain_version_stats(),
        )

    def _drain_version_stats(self) -> list[tuple[int, dict[str, float]]]:
        stats, self.version_stats = self.version_stats, []
        return stats

    def _inflight(self) -> float:
        if self.credits is None:
            return float("nan")
        return float(self.slots if self.credits.inflight_cap is None else self.credits.inflight_cap)
