"""V-trace against a NumPy reference written from the paper's sum (not the recursion), with a
terminated and a truncated episode inside one fragment."""

from __future__ import annotations

import numpy as np
import torch
from gymnasium.spaces import Box, Discrete

from tianji.algos.common.returns import vtrace
from tianji.algos.impala import IMPALAConfig, IMPALALearner, impala_loss


def reference(mu, pi, r, v, v_boot, done, term, gamma, lam, rho_bar, c_bar):
    """v_s = V(x_s) + sum_t (prod_{i<t} gamma_i c_i) delta_t, the product cut at a done row."""
    T, k = r.shape
    values_next = np.concatenate([v[1:], v_boot[None]])
    ratio = np.exp(pi - mu)
    rho, c = np.minimum(rho_bar, ratio), lam * np.minimum(c_bar, ratio)
    disc = gamma * (1.0 - term)
    delta = rho * (r + disc * values_next - v)
    vs = np.zeros_like(v)
    for j in range(k):
        for s in range(T):
            total, weight = 0.0, 1.0
            for t in range(s, T):
                total += weight * delta[t, j]
                if done[t, j]:
                    break
                weight *= disc[t, j] * c[t, j]
            vs[s, j] = v[s, j] + total
    vs_next = np.concatenate([vs[1:], v_boot[None]])
    target = np.where(done, values_next, vs_next)
    adv = np.minimum(rho_bar, ratio) * (r + disc * target - v)
    return vs, adv


def fragment(seed=0, T=7, k=3):
    rng = np.random.default_rng(seed)
    done = np.zeros((T, k), bool)
    term = np.zeros((T, k), bool)
    done[2, 0] = term[2, 0] = True  # env 0: an episode terminates at row 2 (row 3 is the reset row)
    done[4, 1] = True  # env 1: an episode is truncated (time limit) at row 4: bootstrap from row 5's value
    done[6, 2] = term[6, 2] = True  # env 2: terminates on the fragment's last row
    return {
        "mu": rng.normal(-1, 0.3, (T, k)),
        "pi": rng.normal(-1, 0.3, (T, k)),
        "r": rng.normal(0, 1, (T, k)),
        "v": rng.normal(0, 1, (T, k)),
        "v_boot": rng.normal(0, 1, k),
        "done": done,
        "term": term,
    }


def run(f, **kw):
    t = {name: torch.from_numpy(np.asarray(a)) for name, a in f.items()}
    vs, adv = vtrace(t["mu"], t["pi"], t["r"], t["v"], t["v_boot"], t["done"], t["term"], **kw)
    return vs.numpy(), adv.numpy()


def test_vtrace_matches_the_reference_sum_with_terminated_and_truncated_episodes():
    for seed in range(3):
        f = fragment(seed)
        for kw in (
            {"gamma": 0.99, "lam": 1.0, "rho_bar": 1.0, "c_bar": 1.0},
            {"gamma": 0.9, "lam": 0.95, "rho_bar": 0.8, "c_bar": 0.5},
        ):
            vs, adv = run(f, **kw)
            ref_vs, ref_adv = reference(*f.values(), **kw)
            np.testing.assert_allclose(vs, ref_vs, rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(adv, ref_adv, rtol=1e-10, atol=1e-10)


def test_on_policy_vtrace_is_the_n_step_return_and_episodes_do_not_leak():
    f = fragment()
    f["pi"] = f["mu"].copy()  # on-policy: rho = c = 1
    vs, _ = run(f, gamma=0.9, lam=1.0)
    r, v = f["r"], f["v"]
    # env 0 terminated at row 2: v_0 = r0 + .9 r1 + .81 r2, whatever follows
    np.testing.assert_allclose(vs[0, 0], r[0, 0] + 0.9 * r[1, 0] + 0.81 * r[2, 0])
    # env 1 truncated at row 4: bootstraps from V(final observation) = v[5, 1]
    np.testing.assert_allclose(vs[4, 1], r[4, 1] + 0.9 * v[5, 1])
    changed = dict(f, r=f["r"].copy())
    changed["r"][3:, 0] += 100.0  # the next episode's rewards
    np.testing.assert_allclose(run(changed, gamma=0.9, lam=1.0)[0][:3, 0], vs[:3, 0])


def test_truncated_trace_levels_limit_the_correction():
    f = fragment()
    f["pi"] = f["mu"] + 2.0  # the target policy likes these actions much more: ratio e^2
    _, adv = run(f, gamma=0.99, rho_bar=1.0, c_bar=1.0)
    _, adv_loose = run(f, gamma=0.99, rho_bar=100.0, c_bar=100.0)
    assert np.abs(adv).max() < np.abs(adv_loose).max()


def _policy_gradient(
    advantages: torch.Tensor, advantage_norm: str, weights: torch.Tensor | None = None
) -> torch.Tensor:
    logits = torch.zeros(len(advantages), 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, 0]
    zeros = torch.zeros(len(advantages))
    loss, _ = impala_loss(
        logp,
        advantages,
        zeros,
        zeros,
        zeros,
        IMPALAConfig(advantage_norm=advantage_norm, value_coef=0.0, entropy_coef=0.0),
        weights,
    )
    loss.backward()
    return logits.grad


def test_centered_advantages_ignore_a_shift_and_standard_ones_a_scale():
    advantages = torch.tensor([0.3, -1.0, 0.1, 0.5])
    raw, shifted = _policy_gradient(advantages, "none"), _policy_gradient(advantages + 2.0, "none")
    assert not torch.allclose(raw, shifted)  # the paper's loss pushes every action taken when all advantages rise
    torch.testing.assert_close(_policy_gradient(advantages, "center"), _policy_gradient(advantages + 2.0, "center"))
    torch.testing.assert_close(
        _policy_gradient(advantages, "standard"), _policy_gradient(3 * advantages + 2, "standard")
    )
    centered = _policy_gradient(advantages, "center")
    torch.testing.assert_close(centered, _policy_gradient(advantages - advantages.mean(), "none"))


def test_advantages_centred_on_their_weights_keep_their_td_errors_sign():
    """Equal TD errors (2.0) carried by V-trace weights rho < 1 for actions the learner now takes less often:
    centred on their plain mean the low-weight ones turn negative; centred on rho * sum(A) / sum(rho), all
    are 0 and the policy gradient vanishes."""
    rho = torch.tensor([1.0, 1.0, 0.4, 0.4])
    advantages = rho * 2.0
    assert _policy_gradient(advantages, "center").abs().max() > 0.1
    torch.testing.assert_close(_policy_gradient(advantages, "center", rho), torch.zeros(4, 3))
    torch.testing.assert_close(_policy_gradient(advantages, "standard", rho), torch.zeros(4, 3))


def test_the_impala_learner_centres_on_vtrace_weights_only_where_it_centres():
    learner_logp, behaviour_logp = torch.log(torch.tensor([0.8, 0.2])), torch.log(torch.tensor([0.5, 0.5]))
    space = Box(-1.0, 1.0, (3,), np.float32)
    for norm, weighted, expected in [("center", True, [1.0, 0.4]), ("center", False, None), ("none", True, None)]:
        learner = IMPALALearner(IMPALAConfig(advantage_norm=norm, weighted_centre=weighted), space, Discrete(2))
        weights = learner._centre_weights(learner_logp, behaviour_logp)
        if expected is None:
            assert weights is None
        else:
            torch.testing.assert_close(weights, torch.tensor(expected))
