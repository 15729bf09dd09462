"""PPO math against NumPy references and hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tianji.algos.common.correction import anchored_bounds, clip_bounds, normalized_advantages
from tianji.algos.common.returns import compute_gae
from tianji.algos.common.surrogate import ppo_loss
from tianji.algos.ppo import PPOConfig


def gae_reference(rewards, values, bootstrap, dones, terminated, gamma, lam, traces=None):
    """Direct definition: A_t = sum_l (gamma*lam)^l (c_{t+1} ... c_{t+l}) delta_{t+l}, stopping after the
    episode's last step (traces c: 1 unless given)."""
    T, k = rewards.shape
    next_values = np.vstack([values[1:], bootstrap[None]])
    traces = np.ones((T, k)) if traces is None else traces
    adv = np.zeros((T, k))
    for e in range(k):
        for t in range(T):
            total, discount = 0.0, 1.0
            for u in range(t, T):
                delta = rewards[u, e] + gamma * next_values[u, e] * (0.0 if terminated[u, e] else 1.0) - values[u, e]
                total += discount * delta
                if dones[u, e] or u + 1 == T:
                    break
                discount *= gamma * lam * traces[u + 1, e]
            adv[t, e] = total
    return adv


def test_gae_hand_computed_single_env():
    rewards = np.array([[1.0], [1.0], [1.0]], np.float32)
    values = np.array([[0.5], [0.4], [0.3]], np.float32)
    bootstrap = np.array([0.2], np.float32)
    none = np.zeros((3, 1), bool)
    adv, ret = compute_gae(rewards, values, bootstrap, none, none, gamma=0.9, lam=0.5)
    d2 = 1 + 0.9 * 0.2 - 0.3
    d1 = 1 + 0.9 * 0.3 - 0.4
    d0 = 1 + 0.9 * 0.4 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    np.testing.assert_allclose(adv[:, 0], [a0, a1, a2], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + values, rtol=1e-6)


def test_gae_terminated_vs_truncated():
    rewards = np.ones((2, 1), np.float32)
    values = np.array([[1.0], [5.0]], np.float32)  # row 1 is the reset row holding V(final obs) = 5
    bootstrap = np.array([0.0], np.float32)
    done = np.array([[True], [False]])
    terminated_adv, _ = compute_gae(rewards, values, bootstrap, done, done, gamma=0.5, lam=1.0)
    truncated_adv, _ = compute_gae(rewards, values, bootstrap, done, np.zeros_like(done), gamma=0.5, lam=1.0)
    assert terminated_adv[0, 0] == pytest.approx(1 - 1.0)  # no bootstrap after termination
    assert truncated_adv[0, 0] == pytest.approx(1 + 0.5 * 5.0 - 1.0)  # bootstrap from the final obs


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_reference_random(seed):
    rng = np.random.default_rng(seed)
    T, k = 13, 5
    rewards = rng.normal(size=(T, k)).astype(np.float32)
    values = rng.normal(size=(T, k)).astype(np.float32)
    bootstrap = rng.normal(size=k).astype(np.float32)
    dones = rng.random((T, k)) < 0.2
    terminated = dones & (rng.random((T, k)) < 0.5)
    adv, ret = compute_gae(rewards, values, bootstrap, dones, terminated, gamma=0.97, lam=0.9)
    expected = gae_reference(rewards, values, bootstrap, dones, terminated, 0.97, 0.9)
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, expected + values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_gae_with_traces_matches_reference(seed):
    """Cut traces (proximal PPO's trace_cut): each delta further on is weighted by the traces before it."""
    rng = np.random.default_rng(seed)
    T, k = 11, 4
    rewards, values = rng.normal(size=(2, T, k)).astype(np.float32)
    bootstrap = rng.normal(size=k).astype(np.float32)
    dones = rng.random((T, k)) < 0.15
    terminated = dones & (rng.random((T, k)) < 0.5)
    traces = np.minimum(1.0, rng.lognormal(0.0, 0.5, size=(T, k))).astype(np.float32)
    adv, ret = compute_gae(rewards, values, bootstrap, dones, terminated, 0.97, 0.9, traces)
    expected = gae_reference(rewards, values, bootstrap, dones, terminated, 0.97, 0.9, traces)
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, expected + values, rtol=1e-4, atol=1e-5)
    zero_adv, _ = compute_gae(rewards, values, bootstrap, dones, terminated, 0.97, 0.9, np.zeros_like(traces))
    one_step = gae_reference(rewards, values, bootstrap, dones, terminated, 0.97, 0.0)
    np.testing.assert_allclose(zero_adv, one_step, rtol=1e-4, atol=1e-5)  # every trace cut: TD(0)


def ppo_loss_reference(new_logp, old_logp, adv, new_v, ret, entropy, cfg):
    if cfg.advantage_norm == "standard":
        adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    ratio = np.exp(new_logp - old_logp)
    unclipped = adv * ratio
    clipped = adv * np.clip(ratio, 1 - cfg.clip, 1 + cfg.clip)
    policy = -np.minimum(unclipped, clipped).mean()
    value = 0.5 * ((new_v - ret) ** 2).mean()
    return policy + cfg.value_coef * value - cfg.entropy_coef * entropy.mean(), policy, value


@pytest.mark.parametrize("normalize", [True, False])
def test_ppo_loss_matches_reference(normalize):
    rng = np.random.default_rng(1)
    n = 64
    arrays = {
        "new_logp": rng.normal(-0.7, 0.3, n),
        "old_logp": rng.normal(-0.7, 0.3, n),
        "adv": rng.normal(size=n),
        "new_v": rng.normal(size=n),
        "ret": rng.normal(size=n),
        "entropy": rng.random(n),
    }
    cfg = PPOConfig(clip=0.2, value_coef=0.5, entropy_coef=0.01, advantage_norm="standard" if normalize else "none")
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in arrays.items()}
    loss, stats = ppo_loss(t["new_logp"], t["old_logp"], t["adv"], t["new_v"], t["ret"], t["entropy"], cfg)
    ref_loss, ref_policy, ref_value = ppo_loss_reference(*arrays.values(), cfg)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-9)
    assert float(stats["policy_loss"]) == pytest.approx(ref_policy, rel=1e-9)
    assert float(stats["value_loss"]) == pytest.approx(ref_value, rel=1e-9)
    ratio = np.exp(arrays["new_logp"] - arrays["old_logp"])
    assert float(stats["clip_frac"]) == pytest.approx(np.mean(np.abs(ratio - 1) > 0.2))


def test_ppo_loss_gradient_is_clipped_outside_trust_region():
    cfg = PPOConfig(clip=0.2, advantage_norm="none", value_coef=0.0)
    new_logp = torch.tensor([np.log(1.5)], requires_grad=True)  # ratio 1.5 > 1.2 with positive advantage
    loss, _ = ppo_loss(new_logp, torch.zeros(1), torch.ones(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg)
    loss.backward()
    assert new_logp.grad.item() == 0.0


def test_anchored_bounds_match_reference():
    """Bounds on pi / pi_prox that keep pi / mu within 1 +- clip, never narrower than 1 +- step."""
    rng = np.random.default_rng(2)
    prox, behaviour = rng.normal(-1.0, 0.2, 256), rng.normal(-1.0, 0.2, 256)
    low, high = anchored_bounds(torch.tensor(prox), torch.tensor(behaviour), clip=0.1, step=0.0125)
    rho = np.exp(prox - behaviour)
    np.testing.assert_allclose(low.numpy(), np.minimum(0.9 / rho, 1 - 0.0125), rtol=1e-12)
    np.testing.assert_allclose(high.numpy(), np.maximum(1.1 / rho, 1 + 0.0125), rtol=1e-12)
    fresh_low, fresh_high = anchored_bounds(torch.tensor(prox), torch.tensor(prox), clip=0.1, step=0.0125)
    torch.testing.assert_close(fresh_low, torch.full((256,), 0.9, dtype=torch.float64))  # no lag: PPO's clip
    torch.testing.assert_close(fresh_high, torch.full((256,), 1.1, dtype=torch.float64))


@pytest.mark.parametrize(
    "anchor, advantage, stops_at",
    [
        ("behaviour", 1.0, 1.0125),
        ("both", 1.0, 1.0125),
        ("proximal", 1.0, 1.1),
        ("behaviour", -1.0, 0.9 / 1.3),
        ("both", -1.0, 0.9),
        ("proximal", -1.0, 0.9),
    ],
)
def test_where_each_anchor_stops_a_stale_sample(anchor, advantage, stops_at):
    """pi_prox already makes the action 1.3x as likely as the actor did (past mu's 1 + clip = 1.1).
    A good action: anchored at the behaviour policy (behaviour, both) the sample still pushes from pi_prox,
    but only a step (0.125 x clip); anchored at pi_prox (decoupled PPO) it pushes a whole clip further, on
    the strength of the same data. A bad action: the behaviour anchor lets the stale sample pull the policy
    back to mu's region's edge, (1 - clip) / 1.3 = 0.69 of pi_prox, undoing what fresher data taught;
    both and proximal stop it a clip from pi_prox, as far as a fresh sample moves."""
    cfg = PPOConfig(clip=0.1, advantage_norm="none", value_coef=0.0, clip_anchor=anchor)
    prox, behaviour = torch.zeros(1), torch.tensor([-np.log(1.3)], dtype=torch.float32)
    bounds = clip_bounds(prox, behaviour, cfg.clip, cfg.clip_anchor, cfg.proximal_step)

    def gradient(ratio_to_prox: float) -> float:
        new_logp = torch.tensor([np.log(ratio_to_prox)], dtype=torch.float32, requires_grad=True)
        zeros = torch.zeros(1)
        loss, _ = ppo_loss(new_logp, prox, torch.tensor([advantage]), zeros, zeros, zeros, cfg, bounds=bounds)
        loss.backward()
        return new_logp.grad.item()

    onward = 0.005 * advantage  # a little further in the direction the advantage pushes
    assert gradient(1.0) * advantage < 0  # the first step follows the advantage
    assert gradient(stops_at - onward) * advantage < 0
    assert gradient(stops_at + onward) == 0.0


def test_both_anchor_is_behaviour_within_the_proximal_clip():
    """clip_anchor=both: the anchored bounds, held within 1 +- clip of pi_prox."""
    rng = np.random.default_rng(3)
    prox, behaviour = torch.tensor(rng.normal(-1.0, 0.2, 256)), torch.tensor(rng.normal(-1.0, 0.2, 256))
    low, high = clip_bounds(prox, behaviour, 0.1, "both", PPOConfig().proximal_step)
    anchored_low, anchored_high = anchored_bounds(prox, behaviour, clip=0.1, step=0.0125)
    np.testing.assert_allclose(low.numpy(), np.maximum(anchored_low.numpy(), 0.9), rtol=1e-12)
    np.testing.assert_allclose(high.numpy(), np.minimum(anchored_high.numpy(), 1.1), rtol=1e-12)
    assert (low < 1).all() and (high > 1).all()  # every sample's first gradient survives


def test_weighted_centre_matches_reference():
    rng = np.random.default_rng(3)
    adv, rho = rng.normal(size=50), np.minimum(np.exp(rng.normal(0, 0.4, 50)), 1.0)
    centred = adv - rho * adv.sum() / rho.sum()
    expected = centred / (centred.std(ddof=1) + 1e-8)
    got = normalized_advantages(torch.tensor(adv), torch.tensor(rho))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10)
    plain = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    np.testing.assert_allclose(normalized_advantages(torch.tensor(adv)).numpy(), plain, rtol=1e-10)


@pytest.mark.parametrize("weighted", [False, True])
def test_equal_td_errors_teach_nothing_with_the_weighted_centre_only(weighted):
    """Every action equally good (the same TD error c > 0), data drawn by mu = (0.5, 0.5), the learner at
    pi = (0.8, 0.2): V-trace's advantages are rho * c, rho = (1 (truncated), 0.4). The plain mean
    (0.7 c) makes the rarer action's advantage negative and the gradient lowers it further; centred on
    rho * c, every advantage is 0 and the policy stays where it is."""
    logits = torch.tensor([np.log(0.8), np.log(0.2)], dtype=torch.float64, requires_grad=True)
    actions = torch.tensor([0] * 50 + [1] * 50)  # mu's proportions exactly
    mu_logp = torch.full((100,), np.log(0.5), dtype=torch.float64)
    logp = torch.log_softmax(logits, 0)[actions]
    rho = (logp.detach() - mu_logp).exp().clamp(max=1.0)
    zeros = torch.zeros(100, dtype=torch.float64)
    cfg = PPOConfig(clip=0.2, value_coef=0.0, entropy_coef=0.0)
    loss, _ = ppo_loss(
        logp, logp.detach(), rho * 2.0, zeros, zeros, zeros, cfg, baseline_weights=rho if weighted else None
    )
    loss.backward()
    rarer_logit_step = -logits.grad[1].item()  # gradient descent's direction for the rarer action's logit
    if weighted:
        assert rarer_logit_step == pytest.approx(0.0, abs=1e-12)
    else:
        assert rarer_logit_step < -0.1
