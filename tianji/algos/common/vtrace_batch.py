"""What IMPALA and APPO share: the config of V-trace targets and the network (`VTraceConfig`), the actor
side (`VTracePolicy`), a batch of fragments laid side by side (`time_major_batch`), and its V-trace
targets under the learner's policy (`vtrace_of` inside a forward pass, `vtrace_targets` as flat samples
for minibatch steps)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field

from tianji.algos.common.actor_critic import BehaviourPolicy, make_net
from tianji.algos.common.batches import time_major
from tianji.algos.common.correction import RHO_BAR_DESCRIPTION, behaviour_gap, evaluate_steps
from tianji.algos.common.networks import PolicyValueNet
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
from tianji.algos.common.tensors import explained_variance


class VTraceConfig(TrainedConfig):
    """What IMPALA and APPO share: V-trace targets, the loss weights and the network."""

    gamma: float = Field(0.99, ge=0, le=1, description="Discount factor.")
    vtrace_lambda: float = Field(1.0, ge=0, le=1, description="V-trace lambda (scales the trace coefficients c).")
    rho_bar: float = Field(1.0, gt=0, description=RHO_BAR_DESCRIPTION + " V-trace's, as in the paper.")
    c_bar: float = Field(1.0, gt=0, description="V-trace truncation of the trace coefficients c.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
    weighted_centre: bool = Field(
        True,
        description="Where advantages are centred (algo.advantage_norm center or standard), centre "
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


class VTracePolicy(BehaviourPolicy):
    """The actor side: actions and their behaviour log-probs; the learner computes values itself."""

    def __init__(self, cfg: VTraceConfig, obs_space: gym.Space, act_space: gym.Space, placement: object):
        super().__init__(make_net(cfg, obs_space, act_space), act_space)


TIME_MAJOR = ("obs", "action", "logp", "reward", "done", "terminated", "valid")


def time_major_batch(fragments: list[Mapping[str, np.ndarray]], device: torch.device) -> dict[str, torch.Tensor]:
    """Fragments side by side on the env axis ([T, k1 + k2, ...]) and the observations after them
    (`last_obs`, [k1 + k2, ...])."""
    return time_major(fragments, TIME_MAJOR, device, per_env=("last_obs",))


def vtrace_of(
    b: dict[str, torch.Tensor], logp: torch.Tensor, values: torch.Tensor, bootstrap: torch.Tensor, cfg: VTraceConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets v_s and advantages [T, K] of a time-major batch, for the learner's log-probs
    and values of its steps (no gradient through either) and its values after the fragments."""
    return vtrace(
        b["logp"],
        logp.detach(),
        b["reward"].float(),
        values.detach(),
        bootstrap,
        b["done"],
        b["terminated"],
        cfg.gamma,
        cfg.vtrace_lambda,
        cfg.rho_bar,
        cfg.c_bar,
    )


def target_diagnostics(
    b: dict[str, torch.Tensor], logp: torch.Tensor, values: torch.Tensor, vs: torch.Tensor, cfg: VTraceConfig
) -> dict[str, float]:
    """Over the valid steps: how far the learner's policy is from the actors' (`behaviour_gap`) and how
    well its values explain the targets."""
    valid = b["valid"].bool()
    gap = behaviour_gap(b["logp"][valid], logp.detach()[valid], cfg.rho_bar)
    return {**gap, "explained_variance": explained_variance(values.detach()[valid], vs[valid])}


@torch.no_grad()
def vtrace_targets(
    net: PolicyValueNet, b: dict[str, torch.Tensor], cfg: VTraceConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The batch's valid steps as flat samples (observation, action, behaviour log-prob, log-prob and
    value now, V-trace target and advantage) from one forward pass with the current parameters, and
    `target_diagnostics`."""
    logp, _, values = evaluate_steps(net, b["obs"], b["action"])
    vs, advantages = vtrace_of(b, logp, values, net.value(b["last_obs"]), cfg)
    valid = b["valid"].bool()
    samples = {
        "obs": b["obs"][valid],
        "action": b["action"][valid],
        "logp": b["logp"][valid],
        "prox_logp": logp[valid],
        "value": values[valid],
        "vs": vs[valid],
        "adv": advantages[valid],
    }
    return samples, target_diagnostics(b, logp, values, vs, cfg)
