"""IMPALA (Espeholt et al., 2018): actor-critic trained on fragments made by older policies,
corrected by V-trace (`tianji.algos.common.returns`). The algorithm that tolerates lag.

One gradient step per batch by default. With `minibatches` (and `epochs`), V-trace targets are
computed once per batch and each step takes a random share of the batch's samples, from all its
envs (more steps per sample; `epochs` > 1 passes over a batch again, as in the paper's experience
replay, Section 5.2.2, with nothing to bound how far the policy moves: `appo` adds PPO's clip).

The loss (`impala_loss`) is pure and tested; `IMPALAPolicy` runs in actors (it records the
behaviour log-probs and the observation after the fragment), `IMPALALearner` in the learner,
which recomputes values and target log-probs with its current parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field

from tianji.algos.base import (
    AlgoSpec,
    Arrays,
    OnPolicyLearner,
    explained_variance,
)
from tianji.algos.common.batches import minibatch_steps, time_major
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.returns import vtrace
from tianji.algos.common.settings import (
    INIT_DESCRIPTION,
    MODEL_DESCRIPTION,
    ConvLayers,
    ModelName,
    TrainedConfig,
    conv_features_field,
    conv_field,
)
from tianji.algos.ppo import PPOPolicy, centred_advantages, check_spaces, proximal_weights


class VTraceConfig(TrainedConfig):
    """What IMPALA and APPO share: V-trace targets, the loss weights and the network."""

    gamma: float = Field(0.99, ge=0, le=1, description="Discount factor.")
    vtrace_lambda: float = Field(1.0, ge=0, le=1, description="V-trace lambda (scales the trace coefficients c).")
    rho_bar: float = Field(1.0, gt=0, description="V-trace truncation of the importance weights rho.")
    c_bar: float = Field(1.0, gt=0, description="V-trace truncation of the trace coefficients c.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
    weighted_centre: bool = Field(
        True,
        description="Where advantages are centred (APPO's normalisation, IMPALA's advantage_norm), centre "
        "each on its own V-trace weight rho times one mean, sum(A) / sum(rho), instead of on their plain "
        "mean, which turns the shrunken advantages of actions the learner now takes less often negative "
        "and drives the policy toward always taking one action.",
    )
    batch_fragments: int = Field(1, ge=1, description="Fragments gathered into one batch.")
    hidden: list[int] = Field(
        default_factory=lambda: [64, 64], description="Hidden layer sizes of the policy and value MLPs."
    )
    model: ModelName = Field("auto", description=MODEL_DESCRIPTION)
    conv: ConvLayers | None = conv_field()
    conv_features: int | None = conv_features_field()
    init: Literal["default", "orthogonal"] = Field("default", description=INIT_DESCRIPTION)


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
    advantage_norm: Literal["none", "center", "standard"] = Field(
        "none",
        description="What the policy gradient does with the V-trace advantages of a gradient step: none (the "
        "paper), center (subtract their mean: a batch baseline that removes the step-to-step push on every action "
        "taken), standard (also divide by their deviation, as PPO does).",
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
    advantages = advantages.detach()
    if cfg.advantage_norm != "none" and advantages.numel() > 1:
        advantages = centred_advantages(advantages, baseline_weights)
        if cfg.advantage_norm == "standard":
            advantages = advantages / (advantages.std() + 1e-8)
    policy_loss = -(advantages * target_logp).mean()
    value_loss = 0.5 * (vs.detach() - values).pow(2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    return loss, {
        "policy_loss": policy_loss.detach(),
        "value_loss": value_loss.detach(),
        "entropy": entropy_mean.detach(),
    }


def make_net(cfg: VTraceConfig, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space)
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model, cfg.init, cfg.conv, cfg.conv_features)


class IMPALAPolicy(PPOPolicy):
    """PPO's actor side without the value: the learner computes values itself for V-trace."""

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, Arrays]:
        action, logp, _ = self.net.sample(torch.from_numpy(obs))
        action_np = action.numpy()
        env_action = action_np if self.net.discrete else np.clip(action_np, self.low, self.high)
        return env_action, {"action": action_np, "logp": logp.numpy()}

    def finish_fragment(self, fragment: Arrays, last_obs: np.ndarray) -> Arrays:
        return {"last_obs": last_obs}  # the learner bootstraps from it with its own values


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
        stats["approx_kl"] = approx_kl(logp.detach() - b["logp"])
        return loss, stats

    def _centre_weights(self, learner_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor | None:
        """V-trace's rho per sample, which its advantages carry, for centring them (none: the plain mean)."""
        if self.cfg.advantage_norm == "none" or not self.cfg.weighted_centre:
            return None
        return proximal_weights(learner_logp, behaviour_logp, self.cfg.rho_bar)

    def _single_pass(self, b: dict[str, torch.Tensor]) -> dict[str, float]:
        """One gradient step on the whole batch: V-trace from the same forward pass as the loss."""
        c = self.cfg
        obs, action = b["obs"], b["action"]
        T, k = action.shape[:2]
        logp, entropy, values = self.net.evaluate(
            obs.reshape(T * k, *obs.shape[2:]), action.reshape(T * k, *action.shape[2:])
        )
        logp, entropy, values = logp.reshape(T, k), entropy.reshape(T, k), values.reshape(T, k)
        with torch.no_grad():
            bootstrap = self.net.value(b["last_obs"])
        vs, advantages = vtrace(
            b["logp"],
            logp.detach(),
            b["reward"].float(),
            values.detach(),
            bootstrap,
            b["done"],
            b["terminated"],
            c.gamma,
            c.vtrace_lambda,
            c.rho_bar,
            c.c_bar,
        )
        valid = b["valid"].bool()
        weights = self._centre_weights(logp.detach()[valid], b["logp"][valid])
        loss, stats = impala_loss(logp[valid], advantages[valid], values[valid], vs[valid], entropy[valid], c, weights)
        stats.update(self.step(loss, self.sync, self.env_steps))
        stats.update(vtrace_diagnostics(b["logp"][valid], logp.detach()[valid], c.rho_bar))
        stats["explained_variance"] = explained_variance(values.detach()[valid], vs[valid])
        return {**{key: float(value) for key, value in stats.items()}, **trunk_health(self.net)}


@torch.no_grad()
def vtrace_targets(
    net: PolicyValueNet, b: dict[str, torch.Tensor], cfg: VTraceConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The batch's valid steps as flat samples (observation, action, behaviour log-prob, log-prob and
    value now, V-trace target and advantage) from one forward pass with the current parameters, and how far
    that policy is from the actors' (rho, explained variance)."""
    obs, action = b["obs"], b["action"]
    T, k = action.shape[:2]
    logp, _, values = net.evaluate(obs.reshape(T * k, *obs.shape[2:]), action.reshape(T * k, *action.shape[2:]))
    logp, values = logp.reshape(T, k), values.reshape(T, k)
    vs, advantages = vtrace(
        b["logp"],
        logp,
        b["reward"].float(),
        values,
        net.value(b["last_obs"]),
        b["done"],
        b["terminated"],
        cfg.gamma,
        cfg.vtrace_lambda,
        cfg.rho_bar,
        cfg.c_bar,
    )
    valid = b["valid"].bool()
    behaviour = vtrace_diagnostics(b["logp"][valid], logp[valid], cfg.rho_bar)
    diagnostics = {
        "rho_mean": behaviour["rho_mean"],
        "rho_clipped": behaviour["rho_clipped"],
        "explained_variance": explained_variance(values[valid], vs[valid]),
    }
    samples = {
        "obs": obs[valid],
        "action": action[valid],
        "logp": b["logp"][valid],
        "prox_logp": logp[valid],
        "value": values[valid],
        "vs": vs[valid],
        "adv": advantages[valid],
    }
    return samples, diagnostics


def approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi) estimated from log(pi / mu) of the actions taken: (r - 1) - log r."""
    return ((log_ratio.exp() - 1) - log_ratio).mean()


TIME_MAJOR = ("obs", "action", "logp", "reward", "done", "terminated", "valid")


def time_major_batch(fragments: list[Mapping[str, np.ndarray]], device: torch.device) -> dict[str, torch.Tensor]:
    """Fragments side by side on the env axis ([T, k1 + k2, ...]) and the observations after them
    (`last_obs`, [k1 + k2, ...])."""
    return time_major(fragments, TIME_MAJOR, device, per_env=("last_obs",))


def vtrace_diagnostics(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the learner's policy is from the actors': the mean importance weight pi/mu, the share
    of weights V-trace truncates at rho_bar, and the KL(mu || pi) estimate (r - 1) - log r."""
    log_ratio = target_logp - behaviour_logp
    ratio = log_ratio.exp()
    return {
        "rho_mean": float(ratio.mean()),
        "rho_clipped": float((ratio > rho_bar).float().mean()),
        "approx_kl": float(approx_kl(log_ratio)),
    }


SPEC = AlgoSpec("impala", IMPALAConfig, IMPALAPolicy, IMPALALearner, check_spaces)
