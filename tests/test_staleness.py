"""Stale fragments corrected, not only bounded: a fragment the actor made k learner versions ago must
teach the learner about as much as a fresh one.

The reference is the importance-weighted policy gradient at the learner's current parameters,
-mean(pi/mu * A) over the stale batch (what an unbiased off-policy update would follow). PPO's clip
centred on the actor's policy mu zeroes the gradient of every sample already outside the clip; the
correction (the ratio taken to the learner's own policy at the start of the update, each sample weighted
by min(pi_prox/mu, rho_bar), every sample free to move a small step from pi_prox) keeps its direction.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import tianji.algos.mappo as mappo_module
import tianji.algos.ppo as ppo_module
from tianji.algos.base import Placement
from tianji.algos.common.correction import behaviour_gap, clip_bounds, importance_weights
from tianji.algos.common.surrogate import ppo_loss
from tianji.algos.mappo import MAPPOConfig, MAPPOLearner, MAPPOPolicy
from tianji.algos.ppo import PPOConfig, PPOLearner, PPOPolicy

OBS = gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)
ACTIONS = gym.spaces.Discrete(6)
T, K = 32, 16


def fragment(policy: PPOPolicy, rng: np.random.Generator, proximal: bool = True) -> dict[str, np.ndarray]:
    """T x K steps of a contextual bandit made by `policy` (the behaviour policy): reward 1 when the
    action is the one a fixed linear map of the observation prefers, episodes of 8 steps."""
    obs = rng.normal(size=(T, K, 8)).astype(np.float32)
    action, record = policy.act(obs.reshape(T * K, 8))
    best = (obs @ np.linspace(-1, 1, 48).reshape(8, 6)).argmax(-1)
    done = np.zeros((T, K), bool)
    done[7::8] = True
    last_obs = rng.normal(size=(K, 8)).astype(np.float32)
    arrays = {
        "obs": obs,
        "reward": (action.reshape(T, K) == best).astype(np.float32),
        "done": done,
        "terminated": done.copy(),
        "valid": np.ones((T, K), bool),
        **{key: value.reshape(T, K) for key, value in record.items()},
    }
    return {**arrays, **policy.finish_fragment(arrays, last_obs)}


def lagged_learner(
    lag: int, lr: float = 3e-4, seed: int = 0, correction: bool = True
) -> tuple[PPOLearner, PPOPolicy, np.random.Generator]:
    """A learner `lag` versions past the behaviour policy (each version one update of 4 x 4 steps on
    its own fresh batch), and that behaviour policy."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = PPOConfig(lr=lr, clip=0.1, entropy_coef=0.0, value_coef=0.5, hidden=[64, 64], stale_correction=correction)
    learner = PPOLearner(cfg, OBS, ACTIONS)
    behaviour = PPOPolicy(cfg, OBS, ACTIONS, Placement())
    behaviour.load_weights(learner.weights())
    current = PPOPolicy(cfg, OBS, ACTIONS, Placement())
    for _ in range(lag):
        current.load_weights(learner.weights())
        learner.add(fragment(current, rng))
        learner.update()
    return learner, behaviour, rng


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def first_step_gradients(lag: int) -> dict[str, float]:
    """Cosines with the importance-weighted gradient of the first gradient step on a batch `lag`
    versions old, for the clip around the behaviour policy and the correction (`algo.stale_correction`)."""
    learner, behaviour, rng = lagged_learner(lag)
    learner.add(fragment(behaviour, rng))
    samples, stats = learner._samples()
    params = list(learner.net.pi.parameters())
    logp, entropy, value = learner.net.evaluate(samples["obs"], samples["action"])
    cfg = learner.cfg.model_copy(update={"value_coef": 0.0})
    adv = samples["adv"]
    normalised = (adv - adv.mean()) / (adv.std() + 1e-8)
    weighted = flat_grad(-((logp - samples["logp"]).exp() * normalised).mean(), params)
    behaviour_clip, _ = ppo_loss(logp, samples["logp"], adv, value, samples["ret"], entropy, cfg)
    weights = importance_weights(samples["prox_logp"], samples["logp"], cfg.rho_bar)
    bounds = clip_bounds(samples["prox_logp"], samples["logp"], cfg.clip, cfg.clip_anchor, cfg.proximal_step)
    corrected, _ = ppo_loss(logp, samples["prox_logp"], adv, value, samples["ret"], entropy, cfg, None, weights, bounds)
    outside = ((samples["prox_logp"] - samples["logp"]).exp() - 1).abs() > cfg.clip
    return {
        "behaviour": cosine(flat_grad(behaviour_clip, params), weighted),
        "corrected": cosine(flat_grad(corrected, params), weighted),
        "outside": float(outside.float().mean()),
        "kl": stats["behaviour_kl"],
        "ess": stats["rho_ess"],
    }


def test_a_batch_four_versions_old_keeps_the_importance_weighted_direction():
    result = first_step_gradients(lag=4)
    assert 0.005 < result["kl"] < 0.05, result  # as far as Pong's policy moves in 4 versions (KL 0.012)
    assert 0.5 < result["ess"] < 0.99, result  # stale: fewer effective samples than samples
    assert result["outside"] > 0.3, result  # many samples start outside the clip
    assert result["corrected"] >= 0.9, result
    assert result["behaviour"] < 0.5, result  # what the clip around the actor's policy gives (-0.46 here)


def test_a_fresh_batch_is_plain_ppo():
    """With no lag the proximal policy is the behaviour policy: weights 1, the same loss."""
    learner, behaviour, rng = lagged_learner(lag=0)
    learner.add(fragment(behaviour, rng))
    samples, stats = learner._samples()
    torch.testing.assert_close(samples["prox_logp"], samples["logp"], atol=1e-5, rtol=0)
    assert stats["rho_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["behaviour_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["rho_ess"] == pytest.approx(1.0, abs=1e-5)


def test_plain_ppo_measures_the_datas_age_on_its_first_minibatch_step():
    """Without the correction nothing evaluates the batch before training; the update's first step does:
    the effective sample size the balance's lag controller reads is 1 for fresh data, lower for data 4
    versions old, and close to what the correction's full pass measures on the same batch."""
    ess = {}
    for lag in (0, 4):
        learner, behaviour, rng = lagged_learner(lag, correction=False)
        learner.add(fragment(behaviour, rng))
        ess[lag] = learner.update()["rho_ess"]
    assert ess[0] == pytest.approx(1.0, abs=1e-5)
    corrected = first_step_gradients(lag=4)["ess"]  # the same behaviour policy and learner, the whole batch
    assert 0.5 < ess[4] < 0.99 and ess[4] == pytest.approx(corrected, abs=0.05), (ess, corrected)


def test_proximal_values_are_the_learners_own():
    """Advantages and value targets come from the learner's current values, not the actor's stale ones."""
    learner, behaviour, rng = lagged_learner(lag=3)
    batch = fragment(behaviour, rng)
    learner.add(batch)
    samples, _ = learner._samples()
    with torch.no_grad():
        now = learner.net.value(torch.from_numpy(batch["obs"].reshape(T * K, 8)))
    torch.testing.assert_close(samples["value"], now)
    assert not np.allclose(samples["value"].numpy(), batch["value"].reshape(-1))


def spy_on_ppo_loss(monkeypatch, module) -> list[dict]:
    calls: list[dict] = []
    real = ppo_loss

    def spy(
        new_logp, old_logp, advantages, new_values, returns, entropy, cfg, old_values=None, weights=None, bounds=None
    ):
        calls.append(
            {
                "old_logp": old_logp.detach().clone(),
                "weights": None if weights is None else weights.detach().clone(),
                "bounds": None if bounds is None else tuple(bound.detach().clone() for bound in bounds),
            }
        )
        return real(new_logp, old_logp, advantages, new_values, returns, entropy, cfg, old_values, weights, bounds)

    monkeypatch.setattr(module, "ppo_loss", spy)
    return calls


@pytest.mark.parametrize(
    "proximal, anchor", [(True, "proximal"), (True, "behaviour"), (True, "both"), (False, "proximal")]
)
def test_the_ppo_learner_feeds_the_fragments_behaviour_log_probs_into_the_loss(monkeypatch, proximal, anchor):
    learner, behaviour, rng = lagged_learner(lag=2)
    update = {"stale_correction": proximal, "clip_anchor": anchor, "minibatches": 1, "epochs": 1}
    learner.cfg = learner.cfg.model_copy(update=update)
    batch = fragment(behaviour, rng)
    batch["logp"] = batch["logp"] - 0.05 * rng.random((T, K)).astype(np.float32)  # a behaviour policy of its own
    with torch.no_grad():  # the learner's policy before the update: the proximal one
        prox, _, _ = learner.net.evaluate(
            torch.from_numpy(batch["obs"].reshape(T * K, 8)), torch.from_numpy(batch["action"].reshape(-1))
        )
    calls = spy_on_ppo_loss(monkeypatch, ppo_module)
    learner.add(batch)
    learner.update()
    (call,) = calls
    behaviour_logp = batch["logp"].reshape(-1)
    if proximal:  # ratio to the learner's own policy, weights and clip bounds from the fragment's log-probs
        rho = np.exp(prox.numpy() - behaviour_logp)
        np.testing.assert_allclose(np.sort(call["weights"].numpy()), np.sort(np.minimum(rho, 2.0)), rtol=1e-4)
        np.testing.assert_allclose(np.sort(call["old_logp"].numpy()), np.sort(prox.numpy()), rtol=1e-5)
        assert_clipped_as_anchored(call["bounds"], rho, learner.cfg)
    else:  # the clip around the fragment's own log-probs
        assert call["weights"] is None and call["bounds"] is None
        np.testing.assert_allclose(np.sort(call["old_logp"].numpy()), np.sort(behaviour_logp), rtol=1e-6)


TEAM_OBS = gym.spaces.Dict(
    {
        "obs": gym.spaces.Box(-1, 1, (3, 5), np.float32),
        "state": gym.spaces.Box(-1, 1, (7,), np.float32),
        "avail_actions": gym.spaces.Box(0, 1, (3, 4), np.int8),
    }
)
TEAM_ACTIONS = gym.spaces.MultiDiscrete([4] * 3)


def team_fragment(policy: MAPPOPolicy, rng: np.random.Generator, T: int = 6, k: int = 4) -> dict[str, np.ndarray]:
    rows = {"obs": [], "state": [], "avail_actions": [], "first": [], "action": [], "logp": [], "value": []}
    for t in range(T):
        obs = {
            "obs": rng.normal(size=(k, 3, 5)).astype(np.float32),
            "state": rng.normal(size=(k, 7)).astype(np.float32),
            "avail_actions": np.ones((k, 3, 4), np.int8),
            "first": np.full((k, 1), t == 0),
        }
        _, record = policy.act(obs)
        for key, value in {**obs, **record}.items():
            rows[key].append(value)
    arrays = {key: np.stack(value) for key, value in rows.items()}
    arrays.update(
        reward=rng.normal(size=(T, k)).astype(np.float32),
        done=np.zeros((T, k), bool),
        terminated=np.zeros((T, k), bool),
        valid=np.ones((T, k), bool),
        active=np.ones((T, k, 3), np.float32),
    )
    last = {"obs": rng.normal(size=(k, 3, 5)).astype(np.float32), "state": rng.normal(size=(k, 7)).astype(np.float32)}
    return {**arrays, **policy.finish_fragment(arrays, last)}


def moved_mappo_learner(cfg: MAPPOConfig) -> tuple[MAPPOLearner, dict[str, np.ndarray]]:
    """A MAPPO learner and a fragment its policy made, after which the learner's parameters moved on."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    learner = MAPPOLearner(cfg, TEAM_OBS, TEAM_ACTIONS)
    behaviour = MAPPOPolicy(cfg, TEAM_OBS, TEAM_ACTIONS, Placement())
    behaviour.load_weights(learner.weights())
    batch = team_fragment(behaviour, rng)
    with torch.no_grad():
        for p in learner.net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return learner, batch


@pytest.mark.parametrize(
    "recurrent, anchor", [(False, "proximal"), (False, "behaviour"), (False, "both"), (True, "behaviour")]
)
def test_the_mappo_learner_feeds_the_fragments_behaviour_log_probs_into_the_loss(monkeypatch, recurrent, anchor):
    cfg = MAPPOConfig(epochs=1, minibatches=1, recurrent=recurrent, rnn_hidden=8, hidden=[16], clip_anchor=anchor)
    learner, batch = moved_mappo_learner(cfg)
    fresh = MAPPOPolicy(cfg, TEAM_OBS, TEAM_ACTIONS, Placement())
    fresh.load_weights(learner.weights())
    calls = spy_on_ppo_loss(monkeypatch, mappo_module)
    learner.add(batch)
    learner.update()
    (call,) = calls
    with torch.no_grad():
        if recurrent:
            logits = learner_logits_recurrent(fresh, batch)
        else:
            logits, _ = fresh.net.logits(
                torch.from_numpy(batch["obs"].reshape(-1, 3, 5)),
                torch.from_numpy(batch["avail_actions"].reshape(-1, 3, 4)),
            )
    expected_prox = (
        torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(batch["action"].reshape(-1, 3, 1))).squeeze(-1)
    )
    rho = np.exp(expected_prox.numpy().reshape(-1) - batch["logp"].reshape(-1))
    np.testing.assert_allclose(np.sort(call["weights"].numpy()), np.sort(np.minimum(rho, 2.0)), rtol=1e-4, atol=1e-6)
    assert_clipped_as_anchored(call["bounds"], rho, cfg)


def test_plain_mappo_measures_the_datas_age_on_its_first_minibatch_step():
    cfg = MAPPOConfig(epochs=1, minibatches=2, hidden=[16], stale_correction=False)
    learner, batch = moved_mappo_learner(cfg)  # the learner moved on after its policy made the batch
    learner.add(batch)
    stats = learner.update()
    assert 0.0 < stats["rho_ess"] < 0.99 and stats["behaviour_kl"] > 0, stats
    behaviour = MAPPOPolicy(cfg, TEAM_OBS, TEAM_ACTIONS, Placement())
    behaviour.load_weights(learner.weights())  # now the learner's own policy makes the batch: no gap
    learner.add(team_fragment(behaviour, np.random.default_rng(1)))
    assert learner.update()["rho_ess"] == pytest.approx(1.0, abs=1e-5)


def assert_clipped_as_anchored(
    bounds: tuple[torch.Tensor, torch.Tensor] | None, rho: np.ndarray, cfg: PPOConfig | MAPPOConfig
):
    """clip_anchor=proximal: the loss clipped pi / pi_prox to 1 +- clip (no per-sample bounds);
    behaviour: so that pi / mu stays within 1 +- clip, or a step of proximal_step x clip around pi_prox;
    both: behaviour's, within 1 +- clip (`rho` = pi_prox / mu per sample, in any order)."""
    if cfg.clip_anchor == "proximal":
        assert bounds is None
        return
    assert bounds is not None
    step = cfg.proximal_step * cfg.clip
    low, high = (np.sort(bound.numpy()) for bound in bounds)
    expected_low = np.minimum((1 - cfg.clip) / rho, 1 - step)
    expected_high = np.maximum((1 + cfg.clip) / rho, 1 + step)
    if cfg.clip_anchor == "both":
        expected_low, expected_high = np.maximum(expected_low, 1 - cfg.clip), np.minimum(expected_high, 1 + cfg.clip)
    np.testing.assert_allclose(low, np.sort(expected_low), rtol=1e-4)
    np.testing.assert_allclose(high, np.sort(expected_high), rtol=1e-4)


def learner_logits_recurrent(policy: MAPPOPolicy, batch: dict[str, np.ndarray]) -> torch.Tensor:
    """Logits of the batch's steps replayed through the policy's memory from zero, env by env in step."""
    policy.h, policy.h0 = None, None
    out = []
    for t in range(batch["obs"].shape[0]):
        obs = {key: batch[key][t] for key in ("obs", "state", "avail_actions", "first")}
        logits, policy.h = policy.net.logits(
            torch.from_numpy(obs["obs"]), torch.from_numpy(obs["avail_actions"]), policy._memory(obs)
        )
        out.append(logits)
    return torch.cat(out)


def spy_on_compute_gae(monkeypatch, module) -> list[tuple]:
    calls: list[tuple] = []
    real = module.compute_gae

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, "compute_gae", spy)
    return calls


@pytest.mark.parametrize("trace_cut", [True, False])
def test_the_ppo_learner_cuts_gae_traces_by_the_proximal_ratio(monkeypatch, trace_cut):
    """trace_cut: GAE's traces are min(1, pi_prox / mu) of each step's action (none without it)."""
    learner, behaviour, rng = lagged_learner(lag=2)
    learner.cfg = learner.cfg.model_copy(update={"trace_cut": trace_cut})
    batch = fragment(behaviour, rng)
    with torch.no_grad():
        prox, _, _ = learner.net.evaluate(
            torch.from_numpy(batch["obs"].reshape(T * K, 8)), torch.from_numpy(batch["action"].reshape(-1))
        )
    calls = spy_on_compute_gae(monkeypatch, ppo_module)
    learner.add(batch)
    learner._samples()
    ((*_, traces),) = calls
    if not trace_cut:
        assert traces is None
        return
    expected = np.minimum(1.0, np.exp(prox.numpy().reshape(T, K) - batch["logp"]))
    np.testing.assert_allclose(traces, expected, rtol=1e-4)
    assert 0.0 < traces.min() < 1.0  # some cut, none above 1


def test_the_mappo_learner_cuts_the_team_trace_by_the_joint_actions_ratio(monkeypatch):
    """With a team value the trace is the joint action's, min(1, product of the agents' pi_prox / mu)."""
    learner, batch = moved_mappo_learner(MAPPOConfig(epochs=1, minibatches=1, hidden=[16], trace_cut=True))
    with torch.no_grad():
        logits, _ = learner.net.logits(
            torch.from_numpy(batch["obs"].reshape(-1, 3, 5)), torch.from_numpy(batch["avail_actions"].reshape(-1, 3, 4))
        )
    prox = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(batch["action"].reshape(-1, 3, 1))).squeeze(-1)
    calls = spy_on_compute_gae(monkeypatch, mappo_module)
    learner.add(batch)
    learner.update()
    ((_, values, *_, traces),) = calls
    log_ratio = prox.numpy().reshape(batch["logp"].shape) - batch["logp"]
    if values.ndim == 2:  # a team value: the joint action's trace
        expected = np.minimum(1.0, np.exp(log_ratio.sum(-1)))
    else:
        expected = np.minimum(1.0, np.exp(log_ratio)).reshape(traces.shape)
    np.testing.assert_allclose(traces, expected, rtol=1e-4, atol=1e-6)


def test_the_effective_sample_size_of_the_weights_against_a_hand_computed_one():
    """Weights pi / mu of 1, 1, 2 and 0.5: (sum w)^2 / (n sum w^2) = 4.5^2 / (4 x 6.25) = 0.81."""
    behaviour = torch.zeros(4)
    target = torch.tensor([1.0, 1.0, 2.0, 0.5]).log()
    assert behaviour_gap(behaviour, target, rho_bar=1.0)["rho_ess"] == pytest.approx(0.81)
