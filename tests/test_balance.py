"""Rate limiter (fake clock), lag accounting, and the learner's balance rules."""

from __future__ import annotations

import numpy as np

from conftest import FakeAlgoLearner
from tianji.runtime.actor import Fragment
from tianji.runtime.balance import LagStats, RateLimiter
from tianji.runtime.learner import Learner


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
    learner = Learner(FakeAlgoLearner(batch_fragments=1), max_policy_lag=100, backpressure=False,
                      limiter=RateLimiter(target=1.0, tolerance=0.0))
    for _ in range(5):
        assert learner.wants_data()
        learner.consume(fragment(0))
    assert len(learner.backlog) == 5
    while learner.ready():
        learner.update()
    assert learner.version == 5 and not learner.backlog
    # lag is measured when a fragment leaves the backlog to be trained on: 0, 1, 2, 3, 4
    assert learner.lag.take_window() == ([0, 1, 2, 3, 4], [])
