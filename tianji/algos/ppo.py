"""PPO: GAE, clipped surrogate, value loss, entropy bonus, corrected for fragments made by older policies.

The math (`compute_gae`, `ppo_loss`, the correction in `tianji.algos.common.correction`) is pure and
tested against NumPy references; `PPOPolicy` runs inside actors, `PPOLearner` inside the learner.

Stale fragments (`stale_correction`, on by default): a fragment trained on k learner versions after the actor's
policy (the behaviour policy, mu) made it would get little from a clip centred on mu: at the start of
the update many of its samples are already outside the clip and give no gradient. So, as in
"decoupled" PPO (Hilton et al., 2022, batch size-invariance) and APPO, the learner first evaluates the
batch with its own parameters (the proximal policy, pi_prox, and its current values); the ratio is
taken to pi_prox, each sample is weighted by min(pi_prox / mu, rho_bar), and GAE uses the current
values. The clip is centred on pi_prox, or (`clip_anchor: behaviour`, `anchored_bounds`) keeps each
sample's ratio to mu within 1 +- clip, where its advantage was measured, while letting every sample
move a small step from pi_prox: where updates fill the clip, a clip centred on pi_prox lets stale data
push the policy past what they support. With no lag pi_prox = mu and this is PPO exactly.

Fragments arrive in the actor's recording convention (see `tianji.runtime.roles.actor`):
vector envs auto-reset on the step *after* an episode ends, so the row after a
done row holds the final observation and its value. A truncated episode
therefore bootstraps from `values[t + 1]`, a terminated one from zero, and the
reset row itself is marked invalid and masked out of the loss.
"""

from __future__ import annotations

from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field

from tianji.algos.base import AlgoSpec, OnPolicyLearner, Placement
from tianji.algos.common.actor_critic import ActorCriticPolicy, make_net, spaces_check
from tianji.algos.common.batches import joined, minibatch_steps, time_major
from tianji.algos.common.correction import behaviour_gap, evaluate_steps, first_step_gap
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.returns import compute_gae
from tianji.algos.common.settings import (
    INIT_DESCRIPTION,
    MODEL_DESCRIPTION,
    ConvLayers,
    ModelName,
    conv_features_field,
    conv_field,
)
from tianji.algos.common.surrogate import SurrogateConfig, correction_terms, ppo_loss
from tianji.algos.common.tensors import explained_variance, to_device


class PPOConfig(SurrogateConfig):
    name: Literal["ppo"] = Field("ppo", description="Algorithm: proximal policy optimisation (on-policy).")
    lr: float = Field(3e-4, gt=0, description="Learning rate (the start of a schedule).")
    model: ModelName = Field("auto", description=MODEL_DESCRIPTION)
    conv: ConvLayers | None = conv_field()
    conv_features: int | None = conv_features_field()
    init: Literal["default", "orthogonal"] = Field("default", description=INIT_DESCRIPTION)


class PPOPolicy(ActorCriticPolicy):
    """The actor side: samples, log-probs and values; with stale_correction the learner values the
    observation after each fragment itself."""

    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        super().__init__(make_net(cfg, obs_space, act_space), act_space, learner_evaluates=cfg.stale_correction)


class PPOLearner(OnPolicyLearner[PolicyValueNet]):
    cfg: PPOConfig

    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        super().__init__(cfg, make_net(cfg, obs_space, act_space), device)
        self._first_step_gap: dict[str, float] = {}

    def update(self) -> dict[str, float]:
        samples, diagnostics = self._samples()
        self._first_step_gap = {}
        stats = minibatch_steps(samples, self.cfg, self._minibatch_loss, self.step, self.sync, self.env_steps)
        return {**stats, **diagnostics, **self._first_step_gap, **trunk_health(self.net)}

    def _minibatch_loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Stats]:
        logp, entropy, value = self.net.evaluate(b["obs"], b["action"])
        if not self.cfg.stale_correction and not self._first_step_gap:
            self._first_step_gap = first_step_gap(b["logp"], logp, self.cfg.rho_bar)
        weights, bounds = correction_terms(b["prox_logp"], b["logp"], self.cfg)
        return ppo_loss(logp, b["prox_logp"], b["adv"], value, b["ret"], entropy, self.cfg, b["value"], weights, bounds)

    def _samples(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The batch's valid steps as flat samples: observation, action, the behaviour log-prob (`logp`),
        the log-prob and value the clips are centred on (`prox_logp`, `value`), GAE advantage and return."""
        fragments = self.take_batch()
        per_env = ("last_obs",) if self.cfg.stale_correction else ("bootstrap_value",)
        b = time_major(fragments, ("obs", "action", "logp", "value"), self.device, per_env)
        rows = {key: np.asarray(joined(fragments, key, 1)) for key in ("reward", "done", "terminated", "valid")}
        if self.cfg.stale_correction:  # the proximal policy and values: the learner's now
            with torch.no_grad():
                b["prox_logp"], _, b["value"] = evaluate_steps(self.net, b["obs"], b["action"])
                bootstrap = self.net.value(b["last_obs"])
        else:
            b["prox_logp"], bootstrap = b["logp"], b["bootstrap_value"]
        traces = None
        if self.cfg.stale_correction and self.cfg.trace_cut:
            traces = (b["prox_logp"] - b["logp"]).exp().clamp(max=1.0).cpu().numpy()
        adv, ret = compute_gae(
            rows["reward"],
            b["value"].cpu().numpy(),
            bootstrap.cpu().numpy(),
            rows["done"],
            rows["terminated"],
            self.cfg.gamma,
            self.cfg.gae_lambda,
            traces,
        )
        b["adv"], b["ret"] = to_device(adv, self.device), to_device(ret, self.device)
        valid = torch.from_numpy(rows["valid"].reshape(-1)).to(self.device)
        samples = {
            key: b[key].reshape(valid.shape[0], *b[key].shape[2:])[valid]
            for key in ("obs", "action", "logp", "prox_logp", "value", "adv", "ret")
        }
        diagnostics = {"explained_variance": explained_variance(samples["value"], samples["ret"])}
        if self.cfg.stale_correction:
            diagnostics.update(behaviour_gap(samples["logp"], samples["prox_logp"], self.cfg.rho_bar))
        return samples, diagnostics


SPEC = AlgoSpec("ppo", PPOConfig, PPOPolicy, PPOLearner, spaces_check("PPO"))
