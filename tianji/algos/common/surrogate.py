"""PPO's clipped surrogate, value loss and entropy bonus (`ppo_loss`), shared by PPO, MAPPO and APPO, and
the config fields of the GAE-based two (`SurrogateConfig`). The correction of stale fragments it takes
(weights, bounds, the advantages' centre) comes from `tianji.algos.common.correction`."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from pydantic import Field, model_validator

from tianji.algos.common.correction import (
    ADVANTAGE_NORM_DESCRIPTION,
    CLIP_ANCHOR_DESCRIPTION,
    RHO_BAR_DESCRIPTION,
    AdvantageNorm,
    ClipAnchor,
    approx_kl,
    clip_bounds,
    importance_weights,
    shaped_advantages,
)
from tianji.algos.common.optim import Stats
from tianji.algos.common.settings import OptimizerConfig, Rename, TrainedConfig, accept_renamed, adam_eps

NORMALIZE_ADVANTAGES: Rename = ("advantage_norm", {True: "standard", False: "none"})


class SurrogateConfig(TrainedConfig):
    """PPO's clipped surrogate on GAE advantages: the fields PPO and MAPPO share (PPO's defaults)."""

    optimizer: OptimizerConfig = adam_eps(1e-5)
    gamma: float = Field(0.99, ge=0, le=1, description="Discount factor.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip: float = Field(0.2, gt=0, description="PPO ratio clip range.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    epochs: int = Field(4, ge=1, description="Passes over each batch.")
    minibatches: int = Field(4, ge=1, description="Minibatches per epoch.")
    value_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the value prediction to within this distance of "
        "the actor's value estimate in the value loss (PPO2's value clipping; "
        "null: no clipping).",
    )
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    advantage_norm: AdvantageNorm = Field(
        "standard", description=ADVANTAGE_NORM_DESCRIPTION + " Per minibatch (was normalize_advantages: true)."
    )
    stale_correction: bool = Field(
        True,
        description="Correct stale fragments: take the ratio to the learner's own policy at the "
        "start of each update (not the actor's), weight each sample by that policy's probability "
        "over the actor's (truncated at rho_bar), clip as clip_anchor says, and compute advantages "
        "and value targets with the learner's current values. One extra forward pass per batch; "
        "plain PPO when lag is 0 (was algo.proximal).",
    )
    rho_bar: float = Field(
        2.0,
        gt=0,
        description=RHO_BAR_DESCRIPTION + " stale_correction: the weight on each sample's surrogate (V-trace's "
        "1.0 would cut every action the learner now prefers to the actor's weight).",
    )
    clip_anchor: ClipAnchor = Field(
        "proximal",
        description="stale_correction: " + CLIP_ANCHOR_DESCRIPTION + " (measured: docs/algorithms.md).",
    )
    proximal_step: float = Field(
        0.125,
        ge=0,
        le=1,
        description="clip_anchor=behaviour: the move from the learner's policy at the start of the update "
        "every sample may make, as a fraction of clip.",
    )
    trace_cut: bool = Field(
        False,
        description="stale_correction: cut GAE's traces by min(1, pi_prox / mu) of each next action (as "
        "V-trace does), so a stale fragment's advantages follow the learner's policy rather than the actor's.",
    )
    batch_fragments: int = Field(1, ge=1, description="Fragments gathered into one training batch.")
    hidden: list[int] = Field(
        default_factory=lambda: [64, 64], description="Hidden layer sizes of the policy and value MLPs."
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return accept_renamed(
            data, {"proximal": ("stale_correction", None), "normalize_advantages": NORMALIZE_ADVANTAGES}
        )

    @model_validator(mode="after")
    def _parts_of_the_correction_need_it(self) -> SurrogateConfig:
        """trace_cut and a clip_anchor other than proximal shape the stale-fragment correction: without
        it they would do nothing, silently."""
        if not self.stale_correction:
            if self.trace_cut:
                raise ValueError("algo.trace_cut is true but algo.stale_correction is false; set it true")
            if self.clip_anchor != "proximal":
                raise ValueError(
                    f"algo.clip_anchor is {self.clip_anchor!r} but algo.stale_correction is false (the anchor "
                    "places the correction's clip); set algo.stale_correction: true or leave algo.clip_anchor "
                    "at 'proximal'"
                )
        return self


class SurrogateSettings(Protocol):
    """What `ppo_loss` reads of a config (PPO's, MAPPO's and APPO's all have it)."""

    @property
    def clip(self) -> float: ...
    @property
    def value_clip(self) -> float | None: ...
    @property
    def value_coef(self) -> float: ...
    @property
    def entropy_coef(self) -> float: ...
    @property
    def advantage_norm(self) -> AdvantageNorm: ...


def ppo_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    cfg: SurrogateSettings,
    old_values: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    baseline_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped surrogate + value loss - entropy bonus, each a mean over one minibatch of valid steps.

    The ratio is new / old policy, `old_logp` being the actor's policy (plain PPO) or the learner's at
    the start of the update (stale_correction). The ratio is clipped to 1 +- cfg.clip, or to per-sample
    `bounds` (low, high; `correction.clip_bounds`). `weights`: each sample's surrogate times its
    importance weight (`correction.importance_weights`; none: 1).
    With `cfg.value_clip` (and `old_values`), the value loss is the larger of the plain and the
    clipped squared error, the clipped prediction staying within value_clip of old_values.
    `baseline_weights`: the importance weights the advantages already carry (V-trace's); centring
    then takes each sample's weight times one mean (`correction.centred_advantages`).
    """
    advantages = shaped_advantages(advantages, cfg.advantage_norm, baseline_weights)
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - cfg.clip, 1 + cfg.clip) if bounds is None else ratio.clamp(*bounds)
    surrogate = torch.max(-advantages * ratio, -advantages * clipped)
    policy_loss = (surrogate if weights is None else weights * surrogate).mean()
    value_error = (new_values - returns).pow(2)
    if cfg.value_clip is not None and old_values is not None:
        clipped_values = old_values + (new_values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        value_error = torch.max(value_error, (clipped_values - returns).pow(2))
    value_loss = 0.5 * value_error.mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    with torch.no_grad():
        stats: Stats = {
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": entropy_mean.detach(),
            "approx_kl": approx_kl(log_ratio),
            "clip_frac": (clipped != ratio).float().mean(),
        }
    return loss, stats


def correction_terms(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, cfg: SurrogateConfig
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The importance weights and clip bounds `ppo_loss` takes under `cfg.stale_correction` (none and
    none without it: plain PPO)."""
    if not cfg.stale_correction:
        return None, None
    weights = importance_weights(proximal_logp, behaviour_logp, cfg.rho_bar)
    return weights, clip_bounds(proximal_logp, behaviour_logp, cfg.clip, cfg.clip_anchor, cfg.proximal_step)
