"""APPO: asynchronous PPO, the algorithm RLlib and Sample Factory use for Atari. IMPALA's actors and
V-trace targets, PPO's clipped surrogate and several passes over each batch.

Per batch: one forward pass (no gradient) with the learner's current parameters gives values and
the V-trace targets and advantages (`tianji.algos.impala.vtrace_targets`), corrected for the actors'
older policies. Then `epochs` passes of `minibatches` gradient steps on random samples of the
batch: PPO's loss (`tianji.algos.ppo.ppo_loss`) with the ratio pi / mu to the behaviour policy that
made the data (or, `proximal`, to the learner's policy at the start of the update: V-trace's
advantages already carry the importance weight), normalised advantages (each centred on its own
truncated weight times one mean: `tianji.algos.ppo.centred_advantages`), the value regressed to the
V-trace targets.
"""

from __future__ import annotations

from typing import Literal

import gymnasium as gym
import torch
from pydantic import Field

from tianji.algos.base import AlgoSpec, OnPolicyLearner
from tianji.algos.common.batches import minibatch_steps
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.settings import INIT_DESCRIPTION, OptimizerConfig, adam_eps
from tianji.algos.impala import IMPALAPolicy, VTraceConfig, make_net, time_major_batch, vtrace_targets
from tianji.algos.ppo import check_spaces, ppo_loss, proximal_weights


class APPOConfig(VTraceConfig):
    name: Literal["appo"] = Field(
        "appo",
        description="Algorithm: APPO, IMPALA's actors and V-trace targets with "
        "PPO's clipped surrogate and several passes over each batch.",
    )
    lr: float = Field(5e-4, gt=0, description="Learning rate (the start of a schedule).")
    optimizer: OptimizerConfig = adam_eps(1e-5)
    clip: float = Field(0.2, gt=0, description="PPO ratio clip range (the ratio to the behaviour policy).")
    epochs: int = Field(2, ge=1, description="Passes over each batch.")
    minibatches: int = Field(2, ge=1, description="Minibatches (random samples of the batch) per pass.")
    value_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the value prediction to within this distance of "
        "its value before the update in the value loss (null: no clipping).",
    )
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    normalize_advantages: bool = Field(
        True, description="Normalise advantages per minibatch (centred as algo.weighted_centre says)."
    )
    proximal: bool = Field(
        True,
        description="Centre the clip on the learner's own policy at the start of each "
        "update (whose V-trace advantages already carry the truncated weight pi / mu) instead of "
        "the actors' behaviour policy, which a stale fragment may be far from already.",
    )
    init: Literal["default", "orthogonal"] = Field("orthogonal", description=INIT_DESCRIPTION)


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
        centre = b["prox_logp"] if self.cfg.proximal else b["logp"]
        rho = proximal_weights(b["prox_logp"], b["logp"], self.cfg.rho_bar) if self.cfg.weighted_centre else None
        return ppo_loss(logp, centre, b["adv"], values, b["vs"], entropy, self.cfg, b["value"], baseline_weights=rho)


SPEC = AlgoSpec("appo", APPOConfig, IMPALAPolicy, APPOLearner, check_spaces)
