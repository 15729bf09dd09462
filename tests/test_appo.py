"""APPO: its loss against a NumPy reference (V-trace targets and advantages, PPO's clip), the learner
feeding the fragment's behaviour log-probs into V-trace and the clip, and a short learning test."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

import tianji.algos.appo as appo_module
from tianji.algos.appo import APPOConfig, APPOLearner
from tianji.algos.base import Placement
from tianji.algos.common.vtrace_batch import VTracePolicy, time_major_batch, vtrace_targets
from tianji.config import load_config
from tianji.tools.train import train

from test_vtrace import reference as vtrace_reference

OBS = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
ACTIONS = gym.spaces.Discrete(3)
T, K = 12, 4


def fragment(policy: VTracePolicy, seed: int = 0) -> dict[str, np.ndarray]:
    """A fragment made by `policy`, with an episode ending (terminated) in env 0 and one truncated in env 1."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(T, K, 5)).astype(np.float32)
    action, record = policy.act(obs.reshape(T * K, 5))
    done, terminated, valid = np.zeros((T, K), bool), np.zeros((T, K), bool), np.ones((T, K), bool)
    done[4, 0] = terminated[4, 0] = True
    done[7, 1] = True
    valid[5, 0] = valid[8, 1] = False  # the reset rows after them
    arrays = {
        "obs": obs,
        "reward": rng.normal(size=(T, K)).astype(np.float32),
        "done": done,
        "terminated": terminated,
        "valid": valid,
        **{k: v.reshape(T, K) for k, v in record.items()},
    }
    return {**arrays, **policy.finish_fragment(arrays, rng.normal(size=(K, 5)).astype(np.float32))}


def setup(proximal: bool = True, **overrides) -> tuple[APPOLearner, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    anchor = "proximal" if proximal else "behaviour"
    cfg = APPOConfig(hidden=[16], clip_anchor=anchor, gamma=0.9, value_clip=0.3, entropy_coef=0.02, **overrides)
    learner = APPOLearner(cfg, OBS, ACTIONS)
    behaviour = VTracePolicy(cfg, OBS, ACTIONS, Placement())
    behaviour.load_weights(learner.weights())
    with torch.no_grad():  # the learner's policy has moved on since the actor made the fragment
        for p in learner.net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return learner, fragment(behaviour)


def numpy_loss(cfg, mu, prox, new, entropy, values_then, values_now, vs, adv):
    """PPO's clipped surrogate on normalised V-trace advantages (centred on rho times sum(A) / sum(rho),
    or on their mean), value regressed to v_s (clipped around the values the targets were computed
    with), entropy bonus."""
    rho = np.minimum(np.exp(prox - mu), cfg.rho_bar) if cfg.weighted_centre else np.ones_like(adv)
    adv = adv - rho * adv.sum() / rho.sum()
    adv = adv / (adv.std(ddof=1) + 1e-8)
    centre = prox if cfg.clip_anchor == "proximal" else mu
    ratio = np.exp(new - centre)
    policy = -np.minimum(ratio * adv, np.clip(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv).mean()
    clipped = values_then + np.clip(values_now - values_then, -cfg.value_clip, cfg.value_clip)
    value = 0.5 * np.maximum((values_now - vs) ** 2, (clipped - vs) ** 2).mean()
    return policy + cfg.value_coef * value - cfg.entropy_coef * entropy.mean()


@pytest.mark.parametrize("proximal, weighted_centre", [(True, True), (False, True), (True, False)])
def test_appo_loss_matches_a_numpy_reference(proximal, weighted_centre):
    learner, f = setup(proximal, weighted_centre=weighted_centre)
    cfg = learner.cfg
    samples, _ = vtrace_targets(learner.net, time_major_batch([f], learner.device), cfg)
    with torch.no_grad():  # the learner's policy at the start of the update, for the reference's V-trace
        logits, values = learner.net(torch.from_numpy(f["obs"].reshape(T * K, 5)))
        bootstrap = learner.net.value(torch.from_numpy(f["last_obs"]))
    prox_all = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(f["action"].reshape(-1, 1))).numpy()
    prox_all, values_all = prox_all.reshape(T, K).astype(np.float64), values.numpy().reshape(T, K).astype(np.float64)
    vs, adv = vtrace_reference(
        f["logp"].astype(np.float64),
        prox_all,
        f["reward"].astype(np.float64),
        values_all,
        bootstrap.numpy().astype(np.float64),
        f["done"],
        f["terminated"],
        cfg.gamma,
        cfg.vtrace_lambda,
        cfg.rho_bar,
        cfg.c_bar,
    )
    with torch.no_grad():  # one optimizer-like move, so the ratio and the clips matter
        for p in learner.net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    loss, _ = learner._minibatch_loss(samples)
    valid = f["valid"]
    with torch.no_grad():
        new, entropy, now = learner.net.evaluate(
            torch.from_numpy(f["obs"][valid]), torch.from_numpy(f["action"][valid])
        )
    expected = numpy_loss(
        cfg,
        f["logp"][valid],
        prox_all[valid],
        new.numpy(),
        entropy.numpy(),
        values_all[valid],
        now.numpy(),
        vs[valid],
        adv[valid],
    )
    assert loss.item() == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("proximal", [True, False])
def test_the_appo_learner_feeds_the_fragments_behaviour_log_probs_into_vtrace_and_the_clip(monkeypatch, proximal):
    learner, f = setup(proximal, epochs=1, minibatches=1)
    calls = []
    real = appo_module.ppo_loss

    def spy(new_logp, old_logp, *args, **kwargs):
        calls.append(old_logp.detach().clone())
        return real(new_logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(appo_module, "ppo_loss", spy)
    with torch.no_grad():
        prox, _, _ = learner.net.evaluate(
            torch.from_numpy(f["obs"].reshape(T * K, 5)), torch.from_numpy(f["action"].reshape(-1))
        )
    learner.add(f)
    stats = learner.update()
    valid = f["valid"].reshape(-1)
    mu, prox = f["logp"].reshape(-1)[valid], prox.numpy()[valid]
    assert stats["rho_mean"] == pytest.approx(float(np.exp(prox - mu).mean()), rel=1e-4)  # V-trace saw the actor's mu
    (centre,) = calls
    np.testing.assert_allclose(np.sort(centre.numpy()), np.sort(prox if proximal else mu), rtol=1e-5)


@pytest.mark.slow
def test_appo_learns_cartpole(tmp_path):
    cfg = load_config(
        "cartpole-appo", [f"logging.run_root={tmp_path}", "logging.console=false", "stop.max_wall_time_s=180"]
    )
    run_dir, summary = train(cfg, "local")
    assert summary["target_reached"], summary
    assert summary["return_at_target"] >= 475
    # advantages centred on their weights keep the policy from collapsing (benchmarks/results/test-bars.md)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    entropies = [row["train/entropy"] for row in rows if "train/entropy" in row]
    assert min(entropies) > 0.25, entropies
