"""The stale-fragment correction, once for every on-policy algorithm (PPO, MAPPO, IMPALA, APPO).

A fragment trained on k learner versions after the actor's policy (the behaviour policy, mu) made it is
corrected in four steps, each a function here:

    logp, entropy, values = evaluate_steps(net, obs, action)    # the learner's policy now, on [T, K] steps
    rho = importance_weights(prox_logp, behaviour_logp, rho_bar)  # min(pi_prox / mu, rho_bar) per sample
    low, high = clip_bounds(prox_logp, behaviour_logp, ...)       # where the surrogate's clip sits
    adv = normalized_advantages(adv, baseline_weights=rho)        # centred on each sample's own weight
    behaviour_gap(behaviour_logp, prox_logp, rho_bar)             # how far the two policies were apart
    first_step_gap(behaviour_logp, logp, rho_bar)                 # the same, without the correction

pi_prox is the learner's policy at the start of the update (the proximal policy of decoupled PPO,
Hilton et al., 2022; V-trace's target policy when IMPALA and APPO compute their targets). With no lag
pi_prox = mu: the weights are 1, the bounds PPO's 1 +- clip, and each algorithm is its textbook self.
What each algorithm does with these (GAE or V-trace, which clip, which centre) is in its own module;
the metrics they give have one name everywhere (docs/outputs.md).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch

ClipAnchor = Literal["proximal", "behaviour", "both"]
AdvantageNorm = Literal["none", "center", "standard"]

CLIP_ANCHOR_DESCRIPTION = (
    "Where the clip's trust region sits. proximal: 1 +- clip around the learner's "
    "policy at the start of the update (decoupled PPO). behaviour: each sample's ratio to the actor's "
    "policy stays within 1 +- clip (the region its advantage was measured in), and every sample may "
    "move proximal_step x clip from the learner's policy, so a stale one still gives its weighted "
    "gradient. both: behaviour's bounds, and never more than 1 +- clip from the learner's policy, so a "
    "stale sample cannot pull the policy back toward the actor's further than a fresh one moves it. "
    "Pick behaviour or both where updates fill the clip (a high learning rate, train/clip_frac high): "
    "there stale data push a policy anchored at the learner's past what they support."
)
ADVANTAGE_NORM_DESCRIPTION = (
    "What a gradient step does with its advantages: none (as they are), center (subtract their mean: a "
    "batch baseline), standard (center, then divide by their standard deviation)."
)
RHO_BAR_DESCRIPTION = "Truncation of the importance weight pi / mu (the learner's policy over the actor's)."


class StepEvaluator(Protocol):
    """A policy-value net's evaluation of given actions: (log-probs, entropies, values)."""

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


NO_GRAD_PASS_ELEMENTS = 1 << 20
"""Observation elements per forward pass where no gradient is taken (the targets' pass over a whole
batch). A CNN's activations for 1,024 Pong frames outgrow a core's cache: one pass took 140 ms, passes
of 128 frames 105 ms, the outputs equal (AMD EPYC, one thread). Vector observations stay one pass."""


def evaluate_steps(net: StepEvaluator, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The net's log-probs of the actions taken, entropies and values on time-major steps [T, K, ...],
    each shaped [T, K]: one forward pass over all T * K steps, or, without gradient, passes of at most
    `NO_GRAD_PASS_ELEMENTS` observation elements."""
    T, K = action.shape[:2]
    obs, action = obs.reshape(T * K, *obs.shape[2:]), action.reshape(T * K, *action.shape[2:])
    rows = T * K if torch.is_grad_enabled() else max(1, NO_GRAD_PASS_ELEMENTS // math.prod(obs.shape[1:]))
    passes = [net.evaluate(obs[i : i + rows], action[i : i + rows]) for i in range(0, max(T * K, 1), rows)]
    flat = passes[0] if len(passes) == 1 else tuple(torch.cat(outputs) for outputs in zip(*passes, strict=True))
    return tuple(out.reshape(T, K) for out in flat)


def importance_weights(target_logp: torch.Tensor, behaviour_logp: torch.Tensor, rho_bar: float) -> torch.Tensor:
    """min(pi / mu, rho_bar) per sample: how much more (or less) likely the learner's policy makes the
    action than the actor's policy that took it, truncated."""
    return (target_logp - behaviour_logp).exp().clamp(max=rho_bar)


def anchored_bounds(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, clip: float, step: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample bounds on pi / pi_prox that keep pi / mu within 1 +- clip, widened to at least
    1 +- step around pi_prox.

    A stale sample's advantage was measured under mu, so the surrogate it gives holds near mu: the
    learner's policy may already have moved toward (or past) the edge of that region on the strength of
    earlier, similar samples, and a clip centred on pi_prox would let every update take a full step
    more. The step keeps each sample's first gradient (its importance-weighted direction) without
    letting it drive the policy further from mu than the region plus one small step. With no lag
    (pi_prox = mu) these are PPO's bounds 1 +- clip.
    """
    rho = (proximal_logp - behaviour_logp).exp()
    low = ((1 - clip) / rho).clamp(max=1 - step)
    high = ((1 + clip) / rho).clamp(min=1 + step)
    return low, high


def clip_bounds(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, clip: float, anchor: ClipAnchor, step: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bounds the surrogate clips pi / pi_prox to under `anchor` (none: 1 +- clip around pi_prox);
    `step` is the move from pi_prox every sample may make, as a fraction of clip.

    `both` also keeps them within 1 +- clip: anchored bounds alone let a sample the learner's policy has
    already moved past mu's region (rho > 1 + clip) take the policy back down to (1 - clip) / rho, a
    larger step toward mu than any fresh sample takes, undoing what fresher data taught."""
    if anchor == "proximal":
        return None
    low, high = anchored_bounds(proximal_logp, behaviour_logp, clip, step * clip)
    if anchor == "both":
        low, high = low.clamp(min=1 - clip), high.clamp(max=1 + clip)
    return low, high


def centred_advantages(advantages: torch.Tensor, baseline_weights: torch.Tensor | None = None) -> torch.Tensor:
    """A - mean(A), or with `baseline_weights` (rho) A - rho * sum(A) / sum(rho).

    Subtracting one constant from every advantage leaves the policy gradient's expectation alone
    only where the actions were drawn from the policy being measured. V-trace's advantages are
    rho * (TD error), rho = min(pi / mu, rho_bar), of actions an older mu drew: an action the learner
    has come to take less often has rho < 1 and its advantage shrinks toward 0, and a positive mean
    (values still catching up with rising returns) turns it negative, so the policy takes that action
    less still, toward always taking one. Centred on its own weight times one mean, each sample keeps
    rho * (TD error - m): its sign is its TD error's against m, whatever its weight.
    """
    if baseline_weights is None:
        return advantages - advantages.mean()
    return advantages - baseline_weights * (advantages.sum() / baseline_weights.sum())


def normalized_advantages(advantages: torch.Tensor, baseline_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`centred_advantages` scaled to unit standard deviation."""
    centred = centred_advantages(advantages, baseline_weights)
    return centred / (centred.std() + 1e-8)


def shaped_advantages(
    advantages: torch.Tensor, norm: AdvantageNorm, baseline_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The advantages a gradient step uses under `norm` (none, center, standard), centred on
    `baseline_weights` where given (`centred_advantages`); a single sample is left as it is."""
    if norm == "none" or advantages.numel() < 2:
        return advantages
    if norm == "center":
        return centred_advantages(advantages, baseline_weights)
    return normalized_advantages(advantages, baseline_weights)


def approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """KL(old || new) estimated from log(new / old) of actions the old policy took: (r - 1) - log r."""
    return ((log_ratio.exp() - 1) - log_ratio).mean()


def behaviour_gap(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the learner's policy had moved from the actors' when the batch was trained on: the mean
    weight pi / mu (`rho_mean`), the share truncated at rho_bar (`rho_clipped`), KL(mu || pi)
    (`behaviour_kl`), and the weights' effective sample size over their count (`rho_ess`:
    (sum w)^2 / (n sum w^2), 1 for fresh data; what the balance's lag controller reads)."""
    log_ratio = target_logp - behaviour_logp
    ratio = log_ratio.exp()
    return {
        "rho_mean": float(ratio.mean()),
        "rho_clipped": float((ratio > rho_bar).float().mean()),
        "behaviour_kl": float(approx_kl(log_ratio)),
        "rho_ess": float(ratio.sum() ** 2 / (ratio.numel() * ratio.pow(2).sum())),
    }


def first_step_gap(behaviour_logp: torch.Tensor, logp: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """`behaviour_gap` where no pass evaluates the batch before training (PPO without the correction):
    an update's first minibatch step sees the learner's policy before it moves, so its log-probs against
    the actors' (on that minibatch) measure the data's age, for the diagnostics and the balance's lag
    controller (`rho_ess`), at no extra forward pass."""
    return behaviour_gap(behaviour_logp, logp.detach(), rho_bar)
