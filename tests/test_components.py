"""Actor and learner behaviour with fake envs, policies and algorithms."""

from __future__ import annotations

import numpy as np

from tianji.config import build_config
from tianji.runtime.roles.actor import Actor
from tianji.runtime.roles.learner import Learner
from tianji.runtime.roles.service import LearnerService

from conftest import FakeAlgoLearner, FakePolicy, FakeVectorEnv


def make_actor(T=5, k=3, episode_length=4, truncate=False):
    return Actor(
        actor_id=2, envs=FakeVectorEnv(k, episode_length, truncate), policy=FakePolicy(), fragment_length=T, seed=0
    )


def test_actor_fragments_are_shaped_and_stamped():
    actor = make_actor()
    actor.set_weights(3, {"w": np.array([3.0], np.float32)})
    first, second = actor.collect(), actor.collect()
    assert (first.actor_id, first.seq, first.policy_version, first.env_steps) == (2, 0, 3, 15)
    assert second.seq == 1
    a = first.arrays
    assert a["obs"].shape == (5, 3, 2) and a["obs"].dtype == np.float32
    for key in ("action", "w_used", "reward", "terminated", "done", "valid"):
        assert a[key].shape == (5, 3), key
    assert a["last_t"].shape == (3,)  # from the policy's finish_fragment
    assert (a["w_used"] == 3.0).all()


def test_actor_marks_the_reset_step_invalid_and_counts_episodes():
    actor = make_actor(T=6, k=2, episode_length=4)
    fragment = actor.collect()
    a = fragment.arrays
    # steps 0-3 are the episode (done at step 3), step 4 is the reset step, step 5 starts a new episode
    np.testing.assert_array_equal(a["done"][:, 0], [0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(a["valid"][:, 0], [1, 1, 1, 1, 0, 1])
    np.testing.assert_array_equal(a["obs"][4, :, 0], [4, 4])  # the reset row holds the final obs
    assert actor.drain_episodes() == [(4.0, 4), (4.0, 4)]
    assert actor.drain_episodes() == []


def test_actor_picks_up_newest_weights_between_fragments():
    actor = make_actor()
    before = actor.collect()
    actor.set_weights(5, {"w": np.array([5.0], np.float32)})
    actor.set_weights(4, {"w": np.array([4.0], np.float32)})  # older version is ignored
    after = actor.collect()
    assert (before.arrays["w_used"] == 0).all()
    assert after.policy_version == 5 and (after.arrays["w_used"] == 5.0).all()


def test_actor_takes_weights_between_steps_and_keeps_the_oldest_version():
    """balance.refresh_weights=step: weights published mid-fragment act from the next step on; the
    fragment keeps the version it started with (its lag is counted from its oldest weights)."""
    actor = make_actor(T=5)
    published = iter([(1, 1.0), (2, 2.0)])

    def refresh():  # a new version arrives before steps 1 and 2, none after
        version, w = next(published, (None, None))
        if version is not None:
            actor.set_weights(version, {"w": np.array([w], np.float32)})

    fragment = actor.collect(between_steps=refresh)
    np.testing.assert_array_equal(fragment.arrays["w_used"][:, 0], [0, 1, 2, 2, 2])
    assert fragment.policy_version == 0 and actor.version == 2
    assert actor.collect().policy_version == 2


def test_learner_consumes_updates_and_bumps_version():
    learner = Learner(FakeAlgoLearner(batch_fragments=2), max_policy_lag=3)
    actor = make_actor()
    assert learner.consume(actor.collect()) and not learner.ready()
    assert learner.consume(actor.collect()) and learner.ready()
    assert not learner.wants_data()
    learner.update()
    assert learner.version == 1 and learner.updates == 1 and learner.samples_trained == 6
    actor.set_weights(learner.version, learner.weights())
    assert actor.collect().arrays["w_used"][0, 0] == 1.0


def test_learner_drops_fragments_over_the_lag_bound_and_counts_them():
    learner = Learner(FakeAlgoLearner(batch_fragments=1), max_policy_lag=2)
    actor = make_actor()
    stale = actor.collect()  # version 0
    for _ in range(3):
        learner.consume(actor.collect())
        learner.update()
    assert learner.version == 3
    assert not learner.consume(stale)
    assert learner.lag.dropped == 1
    assert learner.lag.dropped_lags[3] == 1
    assert learner.lag.summary()["policy_lag_max"] == 2  # of the fragments trained on: within the bound


def test_evaluator_runs_one_greedy_episode_per_env_on_the_newest_weights():
    from tianji.runtime.roles.evaluator import Evaluator

    evaluator = Evaluator(FakeVectorEnv(num_envs=3, episode_length=4), FakePolicy(), seed=0)
    assert not evaluator.has_new_weights()
    evaluator.set_weights(2, {"w": np.array([2.0], np.float32)})
    assert evaluator.has_new_weights()
    result = evaluator.evaluate()
    assert result == {
        "kind": "eval",
        "role": "evaluator",
        "return_mean": 4.0,
        "return_min": 4.0,
        "length_mean": 4.0,
        "version": 2,
        "episodes": 3,
    }
    assert not evaluator.has_new_weights()
    evaluator.set_weights(1, {"w": np.array([1.0], np.float32)})  # older: ignored
    assert evaluator.version == 2


class ReusingVectorEnv(FakeVectorEnv):
    """Writes every observation into the same array, as some vector envs do."""

    def __init__(self, num_envs: int, episode_length: int):
        self.buffer = np.zeros((num_envs, 2), np.float32)
        super().__init__(num_envs, episode_length)

    def _obs(self) -> np.ndarray:
        self.buffer[:, 0], self.buffer[:, 1] = self.t, np.arange(self.num_envs)
        return self.buffer


def test_a_fragment_of_its_own_keeps_the_first_observation_of_an_env_that_reuses_its_arrays():
    actor = Actor(actor_id=0, envs=ReusingVectorEnv(2, 10), policy=FakePolicy(), fragment_length=3, seed=0)
    first, second = actor.collect(), actor.collect()
    np.testing.assert_array_equal(first.arrays["obs"][:, 0, 0], [0, 1, 2])
    np.testing.assert_array_equal(second.arrays["obs"][:, 0, 0], [3, 4, 5])


def test_service_publishes_weights_delayed_by_publish_delay():
    """balance.publish_delay=2 (a diagnosis of data age): after each update the actors get the weights of two
    updates before, under the newest version; with 0, the newest weights."""

    def published_after_updates(delay, updates=4, varies=False):
        balance = {"publish_delay": delay, "publish_delay_varies": varies}
        cfg = build_config({"name": "t", "algo": {"name": "ppo"}, "balance": balance})
        service = LearnerService(Learner(FakeAlgoLearner(), max_policy_lag=0), cfg)
        actor, out = make_actor(), []
        for _ in range(updates):
            service.take(0, 0, actor.collect(), in_slot=False)
            version, weights = service.step()
            actor.set_weights(version, weights)
            out.append((version, float(weights["w"][0])))
        return out

    assert published_after_updates(0) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert published_after_updates(2) == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]
    # publish_delay_varies: each publish's age drawn from 0..4, as asynchronous data's age varies
    varied = published_after_updates(4, updates=60, varies=True)
    ages = [version - weights for version, weights in varied[4:]]  # the history is full from the fifth on
    assert set(ages) == {0, 1, 2, 3, 4}
    assert [version for version, _ in varied] == list(range(1, 61))  # the newest version: actors take them all


def test_a_fragment_delivered_again_by_its_actor_is_refused_and_counted_never_trained_twice():
    cfg = build_config({"name": "t", "algo": {"name": "ppo"}, "balance": {"max_policy_lag": 8}})
    learner = Learner(FakeAlgoLearner(batch_fragments=4), max_policy_lag=8)
    service = LearnerService(learner, cfg)
    actor = make_actor()
    first, second = actor.collect(), actor.collect()
    for fragment in (first, second, first):  # the first again: a replayed notice, a copied slot
        service.take(b"link-a", 0, fragment, in_slot=False)
    assert learner.fragments_consumed == 2 and service.reporter.event()["fragments_repeated"] == 1
    restarted = make_actor()  # a new process on a new link: it numbers its fragments from 0 again
    service.take(b"link-b", 0, restarted.collect(), in_slot=False)
    assert learner.fragments_consumed == 3


class MeasuredAlgoLearner(FakeAlgoLearner):
    """Reports the importance weights' effective sample size, as the policy-gradient algorithms do."""

    ess = 1.0

    def update(self):
        return {**super().update(), "rho_ess": self.ess}


def test_under_an_auto_lag_bound_the_service_moves_the_bound_and_the_credits_and_says_so():
    cfg = build_config({"name": "t", "algo": {"name": "ppo"}, "balance": {"max_policy_lag": "auto", "lag_start": 4}})
    assert cfg.balance.bound_at_start == 4 and cfg.balance.slots_per_actor == 4
    now = [0.0]
    algo = MeasuredAlgoLearner()
    service = LearnerService(Learner(algo, cfg.balance.bound_at_start), cfg, clock=lambda: now[0])
    actor = make_actor()

    def train(updates: int, waited: float, every_s: float = 1.0) -> None:
        for _ in range(updates):
            service.take(0, 0, actor.collect(), in_slot=False)
            now[0] += every_s
            service.reporter.wait_s += waited * every_s
            published = service.step()
            if published is not None:
                actor.set_weights(*published)

    assert service.credits.inflight_cap == 3 and service.reporter.event()["lag_bound"] == 4
    # the first update opens the window, then 3 windows of 2 s: the learner waited half the time, the data
    # as good as fresh; the first raise doubles the bound
    train(7, waited=0.5)
    assert service.credits.max_policy_lag == service.learner.lag.max_policy_lag == 8
    event = service.reporter.event()
    assert (event["lag_bound"], event["inflight"]) == (8, 4)
    algo.ess = 0.4  # the data stopped teaching
    train(6, waited=0.5)
    assert service.credits.max_policy_lag == 7 and service.reporter.event()["lag_bound"] == 7
    algo.ess = 1.0  # teaching again, the learner starved: back up one version at a time after a lowering
    train(12 * 4, waited=0.5, every_s=0.01)  # fast updates: windows of 4 updates, not 2 s
    assert service.credits.max_policy_lag == 7, "a bound lowered for its data stays out of reach a while"
    train(30 * 4, waited=0.5, every_s=0.01)
    assert [d.bound for d in service.lag_control.decisions] == [8, 7, 8, 9, 10, 11, 12]
    assert service.credits.max_policy_lag == 12 and service.reporter.event()["lag_bound"] == 12


def test_a_fixed_lag_bound_is_reported_as_it_is():
    cfg = build_config({"name": "t", "algo": {"name": "ppo"}, "balance": {"max_policy_lag": 8, "max_inflight": 2}})
    service = LearnerService(Learner(FakeAlgoLearner(), cfg.balance.bound_at_start), cfg)
    assert service.lag_control is None and service.credits.inflight_cap is None
    event = service.reporter.event()
    assert (event["lag_bound"], event["inflight"]) == (8, 2)
