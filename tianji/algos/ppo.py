"""PPO: GAE, clipped surrogate, value loss, entropy bonus, corrected for fragments made by older policies.

The math (`compute_gae`, `ppo_loss`, `proximal_weights`) is pure and tested against NumPy references;
`PPOPolicy` runs inside actors, `PPOLearner` inside the learner.

Stale fragments (`proximal`, on by default): a fragment trained on k learner versions after the actor's
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

from collections.abc import Mapping
from typing import Literal, Protocol

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field, model_validator

from tianji.algos.base import (
    AlgoSpec,
    Arrays,
    OnPolicyLearner,
    Placement,
    explained_variance,
    load_module_weights,
    to_device,
)
from tianji.algos.common.batches import joined, minibatch_steps, time_major
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import Stats
from tianji.algos.common.returns import compute_gae
from tianji.algos.common.settings import (
    INIT_DESCRIPTION,
    MODEL_DESCRIPTION,
    ConvLayers,
    ModelName,
    OptimizerConfig,
    TrainedConfig,
    adam_eps,
    conv_features_field,
    conv_field,
)

# ------------------------------------------------------------------ pure math


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
    normalize_advantages: bool = Field(True, description="Normalise advantages per minibatch.")
    proximal: bool = Field(
        True,
        description="Correct stale fragments: take the ratio to the learner's own policy at the "
        "start of each update (not the actor's), weight each sample by that policy's probability "
        "over the actor's (truncated at rho_bar), clip as clip_anchor says, and compute advantages "
        "and value targets with the learner's current values. One extra forward pass per batch; "
        "plain PPO when lag is 0.",
    )
    rho_bar: float = Field(2.0, gt=0, description="proximal: truncation of the importance weight pi_prox / mu.")
    clip_anchor: Literal["proximal", "behaviour", "both"] = Field(
        "proximal",
        description="proximal: where the clip's trust region sits. proximal: 1 +- clip around the learner's "
        "policy at the start of the update (decoupled PPO). behaviour: each sample's ratio to the actor's "
        "policy stays within 1 +- clip (the region its advantage was measured in), and every sample may "
        "move proximal_step x clip from the learner's policy, so a stale one still gives its weighted "
        "gradient. both: behaviour's bounds, and never more than 1 +- clip from the learner's policy, so a "
        "stale sample cannot pull the policy back toward the actor's further than a fresh one moves it. "
        "Pick behaviour or both where updates fill the clip (a high learning rate, train/clip_frac high): "
        "there stale data push a policy anchored at the learner's past what they support (CartPole, data 4 "
        "updates old: 121k env steps to 475 against 448k); elsewhere it learned as fast or slightly slower.",
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
        description="proximal: cut GAE's traces by min(1, pi_prox / mu) of each next action (as V-trace "
        "does), so a stale fragment's advantages follow the learner's policy rather than the actor's.",
    )
    batch_fragments: int = Field(1, ge=1, description="Fragments gathered into one training batch.")
    hidden: list[int] = Field(
        default_factory=lambda: [64, 64], description="Hidden layer sizes of the policy and value MLPs."
    )

    @model_validator(mode="after")
    def _parts_of_the_correction_need_it(self) -> SurrogateConfig:
        """trace_cut and a clip_anchor other than proximal shape the stale-fragment correction: without
        it they would do nothing, silently."""
        if not self.proximal:
            if self.trace_cut:
                raise ValueError("algo.trace_cut is true but algo.proximal is false; set algo.proximal: true")
            if self.clip_anchor != "proximal":
                raise ValueError(
                    f"algo.clip_anchor is {self.clip_anchor!r} but algo.proximal is false (the anchor places "
                    "the correction's clip); set algo.proximal: true or leave algo.clip_anchor at 'proximal'"
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
    def normalize_advantages(self) -> bool: ...


class PPOConfig(SurrogateConfig):
    name: Literal["ppo"] = Field("ppo", description="Algorithm: proximal policy optimisation (on-policy).")
    lr: float = Field(3e-4, gt=0, description="Learning rate (the start of a schedule).")
    model: ModelName = Field("auto", description=MODEL_DESCRIPTION)
    conv: ConvLayers | None = conv_field()
    conv_features: int | None = conv_features_field()
    init: Literal["default", "orthogonal"] = Field("default", description=INIT_DESCRIPTION)


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
    the start of the update (proximal). The ratio is clipped to 1 +- cfg.clip, or to per-sample
    `bounds` (low, high; `anchored_bounds`). `weights`: each sample's surrogate times its importance
    weight (`proximal_weights`; none: 1).
    With `cfg.value_clip` (and `old_values`), the value loss is the larger of the plain and the
    clipped squared error, the clipped prediction staying within value_clip of old_values.
    `baseline_weights`: the importance weights the advantages already carry (V-trace's); normalising
    then centres each sample on its weight times one mean (`normalized_advantages`).
    """
    if cfg.normalize_advantages and advantages.numel() > 1:
        advantages = normalized_advantages(advantages, baseline_weights)
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
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_frac": (clipped != ratio).float().mean(),
        }
    return loss, stats


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


def proximal_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, rho_bar: float) -> torch.Tensor:
    """min(pi_prox / mu, rho_bar) per sample: how much more (or less) likely the learner's policy at the
    start of the update makes the action than the actor's policy that took it, truncated."""
    return (proximal_logp - behaviour_logp).exp().clamp(max=rho_bar)


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
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, cfg: SurrogateConfig
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bounds `ppo_loss` clips the ratio to under `cfg.clip_anchor` (none: 1 +- clip around pi_prox).

    `both` also keeps them within 1 +- clip: anchored bounds alone let a sample the learner's policy has
    already moved past mu's region (rho > 1 + clip) take the policy back down to (1 - clip) / rho, a
    larger step toward mu than any fresh sample takes, undoing what fresher data taught."""
    if cfg.clip_anchor == "proximal":
        return None
    low, high = anchored_bounds(proximal_logp, behaviour_logp, cfg.clip, cfg.proximal_step * cfg.clip)
    if cfg.clip_anchor == "both":
        low, high = low.clamp(min=1 - cfg.clip), high.clamp(max=1 + cfg.clip)
    return low, high


def staleness_stats(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the learner's policy had moved from the actors' when the batch was trained on: the mean
    weight pi_prox / mu, the share truncated at rho_bar, and KL(mu || pi_prox) (its estimate (r - 1) - log r)."""
    log_ratio = proximal_logp - behaviour_logp
    ratio = log_ratio.exp()
    return {
        "rho_mean": float(ratio.mean()),
        "rho_clipped": float((ratio > rho_bar).float().mean()),
        "behaviour_kl": float(((ratio - 1) - log_ratio).mean()),
    }


# ------------------------------------------------------------------ network


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    """Raise ValueError unless PPO can take these spaces."""
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"PPO needs a Box observation space, got {obs_space}")
    if not isinstance(act_space, (gym.spaces.Discrete, gym.spaces.Box)):
        raise ValueError(f"PPO supports Discrete or Box action spaces, got {act_space}")


def make_net(cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space)
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model, cfg.init, cfg.conv, cfg.conv_features)


# ------------------------------------------------------------------ actor side


class PPOPolicy:
    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        self.net = make_net(cfg, obs_space, act_space)
        self.net.requires_grad_(False)
        self.proximal = getattr(cfg, "proximal", False)  # the learner evaluates the fragment's last obs itself
        self.low = getattr(act_space, "low", None)
        self.high = getattr(act_space, "high", None)

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, Arrays]:
        action, logp, value = self.net.sample(torch.from_numpy(obs))
        action_np = action.numpy()
        env_action = action_np if self.net.discrete else np.clip(action_np, self.low, self.high)
        return env_action, {"action": action_np, "logp": logp.numpy(), "value": value.numpy()}

    @torch.no_grad()
    def greedy(self, obs: np.ndarray) -> np.ndarray:
        action = self.net.greedy(torch.from_numpy(obs)).numpy()
        return action if self.net.discrete else np.clip(action, self.low, self.high)

    @torch.no_grad()
    def finish_fragment(self, fragment: Arrays, last_obs: np.ndarray) -> Arrays:
        extras = {"bootstrap_value": self.net.value(torch.from_numpy(last_obs)).numpy()}
        return {**extras, "last_obs": last_obs} if self.proximal else extras


# ------------------------------------------------------------------ learner side


class PPOLearner(OnPolicyLearner[PolicyValueNet]):
    cfg: PPOConfig

    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        super().__init__(cfg, make_net(cfg, obs_space, act_space), device)

    def update(self) -> dict[str, float]:
        samples, diagnostics = self._samples()
        stats = minibatch_steps(samples, self.cfg, self._minibatch_loss, self.step, self.sync, self.env_steps)
        return {**stats, **diagnostics, **trunk_health(self.net)}

    def _minibatch_loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Stats]:
        logp, entropy, value = self.net.evaluate(b["obs"], b["action"])
        weights = bounds = None
        if self.cfg.proximal:
            weights = proximal_weights(b["prox_logp"], b["logp"], self.cfg.rho_bar)
            bounds = clip_bounds(b["prox_logp"], b["logp"], self.cfg)
        return ppo_loss(logp, b["prox_logp"], b["adv"], value, b["ret"], entropy, self.cfg, b["value"], weights, bounds)

    def _samples(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The batch's valid steps as flat samples: observation, action, the behaviour log-prob (`logp`),
        the log-prob and value the clips are centred on (`prox_logp`, `value`), GAE advantage and return."""
        fragments = self.take_batch()
        per_env = ("last_obs",) if self.cfg.proximal else ("bootstrap_value",)
        b = time_major(fragments, ("obs", "action", "logp", "value"), self.device, per_env)
        rows = {key: np.asarray(joined(fragments, key, 1)) for key in ("reward", "done", "terminated", "valid")}
        if self.cfg.proximal:
            b["prox_logp"], b["value"], bootstrap = self._evaluate_now(b["obs"], b["action"], b["last_obs"])
        else:
            b["prox_logp"], bootstrap = b["logp"], b["bootstrap_value"]
        traces = None
        if self.cfg.proximal and self.cfg.trace_cut:
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
        if self.cfg.proximal:
            diagnostics.update(staleness_stats(samples["prox_logp"], samples["logp"], self.cfg.rho_bar))
        return samples, diagnostics

    @torch.no_grad()
    def _evaluate_now(
        self, obs: torch.Tensor, action: torch.Tensor, last_obs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs of the actions taken and values [T, K] under the current parameters (the proximal
        policy), and the values of the observations after the fragments [K]."""
        T, K = action.shape[:2]
        logp, _, values = self.net.evaluate(
            obs.reshape(T * K, *obs.shape[2:]), action.reshape(T * K, *action.shape[2:])
        )
        return logp.reshape(T, K), values.reshape(T, K), self.net.value(last_obs)


SPEC = AlgoSpec("ppo", PPOConfig, PPOPolicy, PPOLearner, check_spaces)
