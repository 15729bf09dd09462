"""IMPALA (Espeholt et al., 2018): actor-critic trained on fragments made by older policies,
corrected by V-trace (`tianji.algos.common.returns`). The algorithm that tolerates lag.

One gradient step per batch by default. With `minibatches` (and `epochs`), V-trace targets are
computed once per batch and each step takes a random share of the batch's samples, from all its
envs (more steps per sample; `epochs` > 1 passes over a batch again, as in the paper's experience
replay, Section 5.2.2, with nothing to bound how far the policy moves: `appo` adds PPO's clip).

The loss (`impala_loss`) is pure and tested; `VTracePolicy` runs in actors (it records the
behaviour log-probs and the observation after the fragment), `IMPALALearner` in the learner,
which recomputes values and target log-probs with its current parameters
(`tianji.algos.common.vtrace_batch`, shared with APPO).
"""

from __future__ import annotations

from typing import Literal

import gymnasium as gym
import torch
from pydantic import Field

from tianji.algos.base import AlgoSpec, OnPolicyLearner
from tianji.algos.common.actor_critic import make_net, spaces_check
from tianji.algos.common.batches import minibatch_steps
from tianji.algos.common.correction import (
    ADVANTAGE_NORM_DESCRIPTION,
    AdvantageNorm,
    approx_kl,
    evaluate_steps,
    importance_weights,
    shaped_advantages,
)
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.vtrace_batch import (
    VTraceConfig,
    VTracePolicy,
    target_diagnostics,
    time_major_batch,
    vtrace_of,
    vtrace_targets,
)


class IMPALAConfig(VTraceConfig):
    name: Literal["impala"] = Field(
        "impala",
        description="Algorithm: IMPALA, actor-critic with V-trace off-policy correction (tolerates policy lag).",
    )
    lr: float = Field(6e-4, gt=0, description="Learning rate (the start of a schedule).")
    max_grad_norm: float = Field(40.0, gt=0, description="Global gradient-norm clip.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Gradient steps per pass over a batch, each on a random share of "
        "its samples (V-trace targets computed once per batch).",
    )
    epochs: int = Field(1, ge=1, description="Passes over each batch (unbounded policy change: appo clips it).")
    advantage_norm: AdvantageNorm = Field(
        "none", description=ADVANTAGE_NORM_DESCRIPTION + " Per gradient step; none is the paper's."
    )


def impala_loss(
    target_logp: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    vs: torch.Tensor,
    entropy: torch.Tensor,
    cfg: IMPALAConfig,
    baseline_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Policy gradient with V-trace advantages, value regression to v_s, entropy bonus: each a mean over
    the batch's valid steps (the IMPALA paper sums them; see tianji.algos.common.optim for the equivalent settings).
    `cfg.advantage_norm`: center subtracts the advantages' mean first (each sample's weight times one
    mean, with `baseline_weights`: `centred_advantages`), standard also divides by their deviation."""
    advantages = shaped_advantages(advantages.detach(), cfg.advantage_norm, baseline_weights)
    policy_loss = -(advantages * target_logp).mean()
    value_loss = 0.5 * (vs.detach() - values).pow(2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    return loss, {
        "policy_loss": policy_loss.detach(),
        "value_loss": value_loss.detach(),
        "entropy": entropy_mean.detach(),
    }


class IMPALALearner(OnPolicyLearner[PolicyValueNet]):
    """One batch, one gradient step (V-trace computed in the same forward pass), unless `minibatches`
    or `epochs` ask for more: then V-trace targets are computed once per batch with the current
    parameters and the steps take random samples of the batch's valid steps, from every env."""

    cfg: IMPALAConfig

    def __init__(self, cfg: IMPALAConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        super().__init__(cfg, make_net(cfg, obs_space, act_space), device)

    def update(self) -> dict[str, float]:
        batch = time_major_batch(self.take_batch(), self.device)
        if self.cfg.minibatches == 1 and self.cfg.epochs == 1:
            return self._single_pass(batch)
        samples, diagnostics = vtrace_targets(self.net, batch, self.cfg)
        return {
            **minibatch_steps(samples, self.cfg, self._minibatch_loss, self.step, self.sync, self.env_steps),
            **diagnostics,
            **trunk_health(self.net),
        }

    def _minibatch_loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Stats]:
        logp, entropy, values = self.net.evaluate(b["obs"], b["action"])
        weights = self._centre_weights(b["prox_logp"], b["logp"])
        loss, stats = impala_loss(logp, b["adv"], values, b["vs"], entropy, self.cfg, weights)
        stats["approx_kl"] = approx_kl(logp.detach() - b["prox_logp"])  # this update's movement so far
        return loss, stats

    def _centre_weights(self, learner_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor | None:
        """V-trace's rho per sample, which its advantages carry, for centring them (none: the plain mean)."""
        if self.cfg.advantage_norm == "none" or not self.cfg.weighted_centre:
            return None
        return importance_weights(learner_logp, behaviour_logp, self.cfg.rho_bar)

    def _single_pass(self, b: dict[str, torch.Tensor]) -> dict[str, float]:
        """One gradient step on the whole batch: V-trace from the same forward pass as the loss."""
        logp, entropy, values = evaluate_steps(self.net, b["obs"], b["action"])
        with torch.no_grad():
            vs, advantages = vtrace_of(b, logp, values, self.net.value(b["last_obs"]), self.cfg)
        diagnostics = target_diagnostics(b, logp, values, vs, self.cfg)
        valid = b["valid"].bool()
        weights = self._centre_weights(logp.detach()[valid], b["logp"][valid])
        loss, stats = impala_loss(
            logp[valid], advantages[valid], values[valid], vs[valid], entropy[valid], self.cfg, weights
        )
        stats.update(self.step(loss, self.sync, self.env_steps))
        stats["approx_kl"] = self._movement(b, logp.detach(), valid)
        self.step.observe(stats)
        return {**{key: float(value) for key, value in stats.items()}, **diagnostics, **trunk_health(self.net)}

    @torch.no_grad()
    def _movement(self, b: dict[str, torch.Tensor], logp_before: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """How far the step moved the policy: the KL estimate on a few of the batch's valid steps,
        evaluated again after it (a small share of one forward pass)."""
        steps = valid.flatten().nonzero().squeeze(1)
        picked = steps[torch.randperm(len(steps), device=steps.device)[:MOVEMENT_SAMPLES]]
        obs, action = b["obs"].flatten(0, 1)[picked], b["action"].flatten(0, 1)[picked]
        logp_after, _, _ = self.net.evaluate(obs, action)
        return approx_kl(logp_after - logp_before.flatten()[picked])


MOVEMENT_SAMPLES = 64  # steps re-evaluated after a single-pass update for train/approx_kl


SPEC = AlgoSpec("impala", IMPALAConfig, VTracePolicy, IMPALALearner, spaces_check("IMPALA"))
