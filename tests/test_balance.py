"""Rate limiter (fake clock), lag accounting, and the learner's balance rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tianji.runtime.balance import (
    CreditLedger,
    LagController,
    LagStats,
    LagWindow,
    RateLimiter,
    lag_aware_in_flight,
)
from tianji.runtime.roles.actor import Fragment
from tianji.runtime.roles.learner import Learner

from conftest import FakeAlgoLearner, load_benchmark


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rate_limiter_keeps_ratio_inside_the_band():
    limiter = RateLimiter(target=4.0, tolerance=0.25)  # band [3, 5] samples per env step
    limiter.inserted(100)
    assert not limiter.can_insert()  # nothing trained yet: below 3 per step, actors must wait
    limiter.trained(300)
    assert limiter.can_insert()
    assert limiter.can_sample(200) and not limiter.can_sample(201)  # 500 is the upper bound
    limiter.trained(200)
    assert limiter.ratio() == 5.0
    assert not limiter.can_sample(1) and limiter.can_insert()


def test_rate_limiter_never_blocks_both_sides():
    limiter = RateLimiter(target=1.0, tolerance=0.0)
    limiter.inserted(10)
    assert not limiter.can_insert()
    assert limiter.can_sample(64)  # a batch larger than the band must still be allowed when inserts wait


def test_rate_limiter_disabled_allows_everything():
    limiter = RateLimiter(target=None, tolerance=0.1)
    limiter.inserted(10**6)
    assert limiter.can_insert() and limiter.can_sample(10**9)


def test_rate_limiter_records_blocked_time_per_side_with_a_fake_clock():
    clock = FakeClock()
    limiter = RateLimiter(target=2.0, tolerance=0.0, clock=clock)
    limiter.inserted(10)
    assert not limiter.can_insert()  # blocked from t=0
    clock.now = 1.5
    assert not limiter.can_insert()  # still blocked: not double counted
    limiter.trained(20)
    clock.now = 2.0
    assert limiter.can_insert()
    assert limiter.blocked_s == {"insert": 2.0, "sample": 0.0}
    assert not limiter.can_sample(1)  # ratio at the bound: the learner waits from t=2
    clock.now = 5.0
    limiter.inserted(10)
    assert limiter.can_sample(1)
    assert limiter.blocked_s == {"insert": 2.0, "sample": 3.0}


def test_lag_stats_keep_trained_and_dropped_fragments_apart():
    lag = LagStats(max_policy_lag=2)
    assert [lag.admit(5, v) for v in (5, 4, 3, 2, 7)] == [True, True, True, False, True]
    assert lag.dropped == 1
    assert dict(lag.trained) == {0: 2, 1: 1, 2: 1}  # a fragment from a newer version counts as lag 0
    assert dict(lag.dropped_lags) == {3: 1}
    assert lag.take_window() == ([0, 1, 2, 0], [3]) and lag.take_window() == ([], [])
    # the summary is of the fragments trained on: never over the bound
    assert lag.summary() == {"policy_lag_min": 0, "policy_lag_mean": 3 / 4, "policy_lag_max": 2}


def fragment(version: int, env_steps: int = 10) -> Fragment:
    return Fragment({"x": np.zeros(1)}, actor_id=0, seq=0, policy_version=version, env_steps=env_steps)


class ReplayLikeAlgo(FakeAlgoLearner):
    """Always wants data; ready after `warmup` fragments; trains 5 samples per update."""

    def __init__(self, warmup: int):
        super().__init__()
        self.warmup = warmup
        self.added = 0

    def add(self, fragment):
        self.added += 1

    def wants_data(self):
        return True

    def ready(self):
        return self.added >= self.warmup

    def update(self):
        self.updates += 1
        return {}

    def samples_per_update(self):
        return 5


def test_learner_applies_rate_limiter_after_warmup():
    learner = Learner(ReplayLikeAlgo(warmup=2), max_policy_lag=100, limiter=RateLimiter(target=1.0, tolerance=0.0))
    learner.consume(fragment(0))
    assert learner.wants_data() and not learner.ready()  # warm-up: no limit, not counted
    learner.consume(fragment(0))
    assert learner.limiter.steps_inserted == 0  # the ratio counts from here
    assert learner.wants_data() and not learner.ready()
    learner.consume(fragment(0))  # 10 env steps inserted
    assert not learner.wants_data()  # 0 < 1.0 * 10 trained: actors wait
    learner.update()
    learner.update()
    assert learner.limiter.ratio() == 1.0
    assert learner.wants_data() and not learner.ready()  # one more update would pass the bound


def test_on_policy_learner_holds_one_batch_so_credits_stay_back():
    learner = Learner(FakeAlgoLearner(batch_fragments=2), max_policy_lag=4)
    learner.consume(fragment(0))
    assert learner.wants_data()
    learner.consume(fragment(0))
    assert not learner.wants_data() and learner.ready()
    learner.update()
    assert learner.wants_data()


def test_without_backpressure_the_learner_queues_everything_and_lag_grows():
    learner = Learner(
        FakeAlgoLearner(batch_fragments=1),
        max_policy_lag=100,
        backpressure=False,
        limiter=RateLimiter(target=1.0, tolerance=0.0),
    )
    for _ in range(5):
        assert learner.wants_data()
        learner.consume(fragment(0))
    assert len(learner.backlog) == 5
    while learner.ready():
        learner.update()
    assert learner.version == 5 and not learner.backlog
    # lag is measured when a fragment leaves the backlog to be trained on: 0, 1, 2, 3, 4
    assert learner.lag.take_window() == ([0, 1, 2, 3, 4], [])


# ---------------------------------------------------------------- lag-aware credits


def test_ledger_grants_while_every_fragment_in_flight_stays_within_the_lag_bound():
    ledger = CreditLedger(max_policy_lag=2)
    ledger.register(0, b"a", slots=2)
    ledger.register(1, b"b", slots=2)
    # each starts from version 0 and may be trained on after the others: 0, 1, 2 behind fit the bound 2
    assert ledger.grant(version=0, versions_per_fragment=1.0) == [(b"a", 0, 0), (b"b", 0, 0), (b"a", 1, 0)]
    assert ledger.grant(version=0, versions_per_fragment=1.0) == []
    assert ledger.arrived(b"a", 0)
    ledger.release(b"a", 0)  # trained on at version 0 -> version 1
    # b0 and a1 (from version 0) could be trained on after a new one, at version 1 + 2: 3 behind
    assert ledger.grant(version=1, versions_per_fragment=1.0) == []
    assert ledger.arrived(b"b", 0)
    ledger.release(b"b", 0)  # version 2: still, a new fragment could push a1 to 3 behind
    assert ledger.grant(version=2, versions_per_fragment=1.0) == []
    assert ledger.arrived(b"a", 1)
    ledger.release(b"a", 1)  # version 3, nothing in flight: three fit again, the idlest actor first
    assert ledger.grant(version=3, versions_per_fragment=1.0) == [(b"b", 1, 3), (b"a", 0, 3), (b"b", 0, 3)]


def test_ledger_asks_for_the_newest_published_weights():
    ledger = CreditLedger(max_policy_lag=2)
    ledger.register(0, b"a", slots=3)
    # publish_every > 1: version 9 is not published yet, actors can get version 8 at most
    assert ledger.grant(version=9, versions_per_fragment=1.0, published=8) == [(b"a", 0, 8), (b"a", 1, 8)]


def test_ledger_without_lag_awareness_grants_every_slot_at_once():
    ledger = CreditLedger(max_policy_lag=0, lag_aware=False)
    ledger.register(0, b"a", slots=3)
    assert ledger.grant(version=7, versions_per_fragment=5.0) == [(b"a", 0, 0), (b"a", 1, 0), (b"a", 2, 0)]


def test_ledger_always_lets_one_fragment_fly_even_when_one_is_worth_more_than_the_bound():
    ledger = CreditLedger(max_policy_lag=1)
    ledger.register(0, b"a", slots=2)
    assert ledger.grant(version=10, versions_per_fragment=8.0) == [(b"a", 0, 10)]
    assert ledger.grant(version=10, versions_per_fragment=8.0) == []
    # DQN-like: 8 versions per fragment, bound 16 -> three in flight (0, 8, 16 versions ahead)
    ledger = CreditLedger(max_policy_lag=16)
    ledger.register(0, b"a", slots=4)
    assert [m for *_, m in ledger.grant(version=20, versions_per_fragment=8.0)] == [20, 20, 20]


def test_ledger_accepts_only_notices_for_slots_it_granted_to_that_actor():
    ledger = CreditLedger(max_policy_lag=8)
    ledger.register(0, b"a", slots=2)
    assert not ledger.arrived(b"a", 0)  # held by the learner, never granted
    ledger.grant(version=0, versions_per_fragment=1.0)
    assert not ledger.arrived(b"x", 0)  # unknown sender
    assert not ledger.arrived(b"a", 5) and not ledger.arrived(b"a", "0")
    assert ledger.arrived(b"a", 0) and not ledger.arrived(b"a", 0)  # once
    ledger.release(b"a", 0)
    assert ledger.in_flight() == 1
    # a restarted actor (same id, new connection) replaces its predecessor, whose grants are void
    ledger.register(0, b"a2", slots=2)
    assert ledger.in_flight() == 0 and not ledger.arrived(b"a", 1)
    ledger.register(0, b"a2", slots=2)  # a repeated hello changes nothing
    assert len(ledger.grant(version=0, versions_per_fragment=1.0)) == 2


def simulate(
    actors: int, slots: int, bound: int, update_s: float, seed: int, spread: float = 0.2, fragments: int = 2000
) -> dict:
    """Discrete-event run of a learner and actors using the ledger: random fragment times, the
    learner trains one update per fragment (PPO), publishes at once and, being one thread, grants
    credits only between updates. A fragment takes 1 +- `spread` (normal) time units. Returns lag counts."""
    import heapq

    from tianji.runtime.roles.learner import VERSIONS_EMA

    rng = np.random.default_rng(seed)
    ledger, lag = CreditLedger(bound), LagStats(bound)
    for a in range(actors):
        ledger.register(a, bytes([a]), slots)
    version, vpf, last_admit = 0, 1.0, None
    credits = {a: [] for a in range(actors)}  # granted, not started: (slot, min_version)
    busy = dict.fromkeys(range(actors), False)
    arrived = []  # notices waiting at the learner: (actor, slot, version)
    clock, queue, learner_busy_until, done = 0.0, [], 0.0, 0

    def grant():
        for identity, slot, min_version in ledger.grant(version, vpf):
            credits[identity[0]].append((slot, min_version))

    def start_actors():
        for a in range(actors):
            if not busy[a] and credits[a] and version >= credits[a][0][1]:
                slot, _ = credits[a].pop(0)
                busy[a] = True
                heapq.heappush(queue, (clock + max(0.05, 1 + spread * rng.standard_normal()), a, slot, version))

    grant()
    start_actors()
    while done < fragments:
        clock, a, slot, made_with = heapq.heappop(queue)
        if a >= 0:  # an actor finished a fragment
            busy[a] = False
            arrived.append((a, slot, made_with))
        else:  # the learner finished an update
            version += 1
        learner_idle = clock >= learner_busy_until
        if learner_idle and arrived:
            a_, slot_, made_with_ = arrived.pop(0)
            assert ledger.arrived(bytes([a_]), slot_)
            ledger.release(bytes([a_]), slot_)
            if last_admit is not None:
                vpf += VERSIONS_EMA * (version - last_admit - vpf)
            last_admit = version
            if lag.admit(version, made_with_):
                learner_busy_until = clock + update_s
                heapq.heappush(queue, (learner_busy_until, -1, 0, 0))
                learner_idle = False
            done += 1
        if learner_idle:
            grant()
        start_actors()
    return {"dropped": lag.dropped, "trained": sum(lag.trained.values()), "max": max(lag.trained)}


@pytest.mark.parametrize(
    "actors, slots, bound, update_s, spread",
    [
        (2, 2, 2, 0.5, 0.2),  # learner faster than the actors
        (2, 2, 2, 1.5, 0.2),  # learner the bottleneck
        (4, 2, 2, 0.3, 1.0),  # fragment times vary a lot: fast fragments overtake slow ones
        (8, 4, 3, 0.2, 1.0),
        (2, 2, 0, 0.5, 0.2),  # strictly synchronous
    ],
)
def test_lag_aware_credits_waste_nothing_in_a_simulated_run(actors, slots, bound, update_s, spread):
    result = simulate(actors, slots, bound, update_s, seed=actors * 10 + bound, spread=spread)
    assert result["dropped"] == 0, result  # plain credits drop 20-80 % of these fragments
    assert result["max"] <= bound


def ledger_mean_in_flight(bound: int, vpf: float, actors: int, slots: int) -> float:
    """The ledger driven the way the planner models it: the learner is the bottleneck (actors fill a granted
    slot at once), trains the oldest fragment first, and moves `vpf` versions per fragment. The mean number
    of fragments in flight over whole periods of its sawtooth (a burst of grants drained one per step)."""
    ledger = CreditLedger(bound)
    for a in range(actors):
        ledger.register(a, a, slots)
    version, queue, total = 0.0, [], 0
    steps = 40 * (int(bound / vpf) + 1)  # whole periods
    for _ in range(steps):
        queue.extend(ledger.grant(version, vpf))
        total += ledger.in_flight()
        identity, slot, _ = queue.pop(0)
        ledger.arrived(identity, slot)
        ledger.release(identity, slot)
        version += vpf
    return total / steps


@pytest.mark.parametrize("vpf", [0.25, 0.5, 1.0, 1.5, 2.0, 3.0])
def test_the_planners_lag_model_keeps_as_many_fragments_in_flight_as_the_ledger(vpf):
    """tianji.tools.plan predicts throughput with `lag_aware_in_flight`; the ledger decides. The same number
    for a grid of bounds and actor counts (fewer slots than that cap it, as the planner caps it by actors)."""
    for bound in range(13):
        for actors, slots in ((1, 32), (2, 16), (4, 8), (8, 4), (2, 1), (3, 1)):
            mean = ledger_mean_in_flight(bound, vpf, actors, slots)
            assert int(mean) == min(lag_aware_in_flight(bound, vpf), actors * slots), (bound, actors, slots, mean)


def test_a_resync_after_a_cut_link_voids_the_actors_unarrived_grants_and_counts_what_was_lost():
    ledger = CreditLedger(max_policy_lag=8)
    ledger.register(0, b"a", slots=4)
    granted = [slot for _, slot, _ in ledger.grant(version=0, versions_per_fragment=1.0)]
    assert granted == [0, 1, 2, 3]
    assert ledger.arrived(b"a", 0)  # slot 0's fragment made it before the cut; slots 1 and 2 were sent, 3 not
    ledger.resync(b"a", sent={1, 2})
    assert (ledger.resyncs, ledger.fragments_lost, ledger.credits_voided) == (1, 2, 1)
    assert ledger.in_flight() == 1  # only the fragment that arrived is still the learner's to train
    assert [slot for _, slot, _ in ledger.grant(version=0, versions_per_fragment=1.0)] == [1, 2, 3]
    assert not ledger.arrived(b"a", 5) and ledger.arrived(b"a", 1)  # grants anew, read as usual


# ---------------------------------------------------------------- the lag bound chosen online

TRACES = Path(__file__).parent / "data" / "lag-traces"


def trace(name: str, ess: bool = True) -> list[LagWindow]:
    """A recorded run's windows (tests/data/lag-traces/README.md)."""
    rows = [json.loads(line) for line in (TRACES / f"{name}.jsonl").read_text().splitlines()]
    return [LagWindow(r["perf/learner_wait"], r["train/rho_ess"] if ess else float("nan")) for r in rows]


def replay(control: LagController, windows: list[LagWindow]) -> list[int]:
    """The bound after each window."""
    bounds = []
    for window in windows:
        control.observe(window)
        bounds.append(control.bound)
    return bounds


def test_the_lag_controller_raises_the_bound_while_the_learner_waits_and_the_data_teach():
    control = LagController(bound=1)
    bounds = replay(control, trace("fresh"))
    assert bounds[-1] > 1 and bounds == sorted(bounds), bounds
    assert all("waited" in d.reason for d in control.decisions)
    assert control.inflight > 1  # the credits follow the bound


def test_the_lag_controller_doubles_the_bound_until_it_first_lowers_it_then_moves_one_version():
    control = LagController(bound=1, ceiling_windows=3)
    starved, stale = LagWindow(0.5, 1.0), LagWindow(0.0, 0.5)
    assert replay(control, [starved] * 9) == [1, 1, 2, 2, 2, 4, 4, 4, 8]  # 3 decisions from 1 to 8, not 7
    assert replay(control, [stale] * 3 + [starved] * 6) == [8, 8, 7, 7, 7, 8, 8, 8, 9]


def test_the_lag_controller_lowers_the_bound_when_stale_data_stop_teaching():
    control = LagController(bound=8)
    bounds = replay(control, trace("fast"))
    assert bounds[-1] < 8 and bounds == sorted(bounds, reverse=True), bounds
    assert all("stopped teaching" in d.reason for d in control.decisions)


def test_the_lag_controller_holds_still_on_a_steady_trace():
    control = LagController(bound=8)
    assert set(replay(control, trace("steady"))) == {8} and control.decisions == []


def test_the_lag_controller_never_raises_without_a_measure_of_the_data():
    assert set(replay(LagController(bound=2), trace("fresh", ess=False))) == {2}


def test_the_lag_controller_settles_after_a_change_rather_than_oscillating():
    """Starved, then steady: the bound climbs, then stays where it got to (one direction, no way back)."""
    control = LagController(bound=1)
    bounds = replay(control, trace("fresh") + trace("steady") * 3)
    settled = bounds[len(trace("fresh")) :]
    assert len(set(settled)) == 1 and settled[0] > 1, bounds


def test_the_lag_controller_keeps_to_its_limits():
    control = LagController(bound=40, high=16)
    assert control.bound == 16
    replay(control, [LagWindow(0.5, 1.0)] * 30)
    assert control.bound == 16 and control.inflight == 4
    replay(control, [LagWindow(0.0, 0.1)] * 90)
    assert control.bound == 1 and control.inflight == 1


def test_a_bound_lowered_for_its_data_is_out_of_reach_for_a_while_then_tried_again():
    control = LagController(bound=4, ceiling_windows=9)
    replay(control, [LagWindow(0.0, 0.5)] * 3)
    assert control.bound == 3
    starved = [LagWindow(0.5, 1.0)] * 12
    assert replay(control, starved) == [3] * 8 + [4, 4, 4, 5]  # held for 9 windows, then raised every 3


def test_the_balance_benchmark_judges_auto_against_the_best_fixed_median_and_its_own_start(monkeypatch):
    balance = load_benchmark(monkeypatch, "balance")

    def run(start, mode, seed, minutes):
        reached = minutes is not None
        return {
            "task": "pong", "start": start, "mode": mode, "seed": seed, "reached": reached,
            "time_to_target_s": minutes * 60 if reached else None, "env_steps_to_target": 8e5 if reached else None,
            "bound_last": 4 if mode == "auto" else None, "bound_range": [1, 6] if mode == "auto" else None,
            "machine": "2 cores, test",
        }  # fmt: skip

    runs = [run("best", "fixed", s, m) for s, m in enumerate((10, 11, 12))]
    runs += [run("tight", "fixed", s, m) for s, m in enumerate((15, 16, None))]  # a miss counts as over the cap
    runs += [run("tight", "auto", s, m) for s, m in enumerate((10.5, 11.5, 13))]  # 11.5 / 11: within 10 %
    runs += [run("loose", "fixed", s, m) for s, m in enumerate((14, 14, 14))]
    runs += [run("loose", "auto", s, m) for s, m in enumerate((13, 13.5, None))]  # 13.5 / 11: not within
    runs[-1]["cap_min"] = 20.0  # a sitting with --minutes 20: its miss reads as over its own cap
    table = balance.markdown("pong", runs)
    assert "(13.0 min, 13.5 min, >20 min; 2/3 reached)" in table and "capped at 20 / 30 minutes" in table
    assert "- from tight: auto within 10% of the best fixed median (1.05x); below its own fixed median." in table
    assert "- from loose: auto NOT within 10% of the best fixed median (1.23x); below its own fixed median." in table
    assert "16.0 min (15.0 min, 16.0 min, >30 min; 2/3 reached)" in table
    assert "| 4 (1-6) |" in table
    runs += [run("best", "auto", s, m) for s, m in enumerate((None, None, 9))]  # its median is over the cap
    assert "| >30 min (>30 min, >30 min, 9.0 min; 1/3 reached) | over the cap | over the cap |" in balance.markdown(
        "pong", runs
    )
    assert balance.Start("tight", 1, 2, 2).settings("auto") == [
        "balance.max_policy_lag=auto", "balance.lag_start=1", "topology.actors=2", "balance.max_inflight=2"
    ]  # fmt: skip


def test_a_benchmark_sitting_reads_a_run_it_made_but_makes_an_interrupted_one_again(monkeypatch, tmp_path):
    common = load_benchmark(monkeypatch, "common")
    ended, interrupted, old, empty = (tmp_path / name for name in ("ended", "interrupted", "old", "empty"))
    for run_dir, summary in ((ended, {"stop_reason": "max_wall_time"}), (interrupted, {"stop_reason": "interrupted"})):
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps(summary))
    old.mkdir()
    (old / "summary.json").write_text("{}")  # a summary from before stop_reason was written: it ended
    empty.mkdir()  # killed before the summary
    assert [common.finished(d) for d in (ended, interrupted, old, empty)] == [True, False, True, False]
