"""APPO: asynchronous PPO, the algorithm RLlib and Sample Factory use for Atari. IMPALA's actors and
V-trace targets, PPO's clipped surrogate and several passes over each batch.

Per batch: one forward pass (no gradient) with the learner's current parameters gives values and
the V-trace targets and advantages (`tianji.algos.common.vtrace_batch.vtrace_targets`), corrected for
the actors' older policies. Then `epochs` passes of `minibatches` gradient steps on random samples of
the batch: PPO's loss (`tianji.algos.common.surrogate.ppo_loss`) with its clip centred on the learner's
policy at the start of the update (`clip_anchor: proximal`: V-trace's advantages already carry the
importance weight) or on the behaviour policy that made the data (`clip_anchor: behaviour`, the ratio
pi / mu), normalised advantages (each centred on its own truncated weight times one mean:
`tianji.algos.common.correction.centred_advantages`), the value regressed to the V-trace targets.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import torch
from pydantic import Field, model_validator

from tianji.algos.base import AlgoSpec, OnPolicyLearner
from tianji.algos.common.actor_critic import make_net, spaces_check
from tianji.algos.common.batches import minibatch_steps
from tianji.algos.common.correction import ADVANTAGE_NORM_DESCRIPTION, AdvantageNorm, approx_kl, importance_weights
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.settings import INIT_DESCRIPTION, OptimizerConfig, accept_renamed, adam_eps
from tianji.algos.common.surrogate import NORMALIZE_ADVANTAGES, ppo_loss
from tianji.algos.common.vtrace_batch import VTraceConfig, VTracePolicy, time_major_batch, vtrace_targets


class APPOConfig(VTraceConfig):
    name: Literal["appo"] = Field(
        "appo",
        description="Algorithm: APPO, IMPALA's actors and V-trace targets with "
        "PPO's clipped surrogate and several passes over each batch.",
    )
    lr: float = Field(5e-4, gt=0, description="Learning rate (the start of a schedule).")
    optimizer: OptimizerConfig = adam_eps(1e-5)
    clip: float = Field(0.2, gt=0, description="PPO ratio clip range.")
    epochs: int = Field(2, ge=1, description="Passes over each batch.")
    minibatches: int = Field(2, ge=1, description="Minibatches (random samples of the batch) per pass.")
    value_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the value prediction to within this distance of "
        "its value before the update in the value loss (null: no clipping).",
    )
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    advantage_norm: AdvantageNorm = Field(
        "standard",
        description=ADVANTAGE_NORM_DESCRIPTION + " Per minibatch, centred as algo.weighted_centre says "
        "(was normalize_advantages: true).",
    )
    clip_anchor: Literal["proximal", "behaviour"] = Field(
        "proximal",
        description="Where the clip's trust region sits. proximal: 1 +- clip around the learner's own policy "
        "at the start of each update (whose V-trace advantages already carry the truncated weight pi / mu); "
        "behaviour: the ratio pi / mu to the actors' policy within 1 +- clip, which a stale fragment may be "
        "far from already (was algo.proximal: true / false).",
    )
    init: Literal["default", "orthogonal"] = Field("orthogonal", description=INIT_DESCRIPTION)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        proximal = ("clip_anchor", {True: "proximal", False: "behaviour"})
        return accept_renamed(data, {"proximal": proximal, "normalize_advantages": NORMALIZE_ADVANTAGES})


class APPOLearner(OnPolicyLearner[PolicyValueNet]):
    cfg: APPOConfig

    def __init__(self, cfg: APPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        super().__init__(cfg, make_net(cfg, obs_space, act_space), device)

    def update(self) -> dict[str, float]:
        samples, diagnostics = vtrace_targets(self.net, time_major_batch(self.take_batch(), self.device), self.cfg)
        return {
            **minibatch_steps(samples, self.cfg, self._minibatch_loss, self.step, self.sync, self.env_steps),
            **diagnostics,
            **trunk_health(self.net),
        }

    def _minibatch_loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Stats]:
        logp, entropy, values = self.net.evaluate(b["obs"], b["action"])
        centre = b["prox_logp"] if self.cfg.clip_anchor == "proximal" else b["logp"]
        rho = importance_weights(b["prox_logp"], b["logp"], self.cfg.rho_bar) if self.cfg.weighted_centre else None
        loss, stats = ppo_loss(
            logp, centre, b["adv"], values, b["vs"], entropy, self.cfg, b["value"], baseline_weights=rho
        )
        if self.cfg.clip_anchor == "behaviour":  # ppo_loss measured it from mu: the update's movement is from pi_prox
            stats["approx_kl"] = approx_kl(logp.detach() - b["prox_logp"])
        return loss, stats


SPEC = AlgoSpec("appo", APPOConfig, VTracePolicy, APPOLearner, spaces_check("APPO"))
