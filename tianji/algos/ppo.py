"""PPO: GAE, clipped surrogate with the behaviour policy's log-probs, value loss, entropy bonus.

The math (`compute_gae`, `ppo_loss`) is pure and tested against NumPy references;
`PPOPolicy` runs inside actors, `PPOLearner` inside the learner.

Fragments arrive in the actor's recording convention (see `tianji.runtime.roles.actor`):
vector envs auto-reset on the step *after* an episode ends, so the row after a
done row holds the final observation and its value. A truncated episode
therefore bootstraps from `values[t + 1]`, a terminated one from zero, and the
reset row itself is marked invalid and masked out of the loss.
"""

from __future__ import annotations

from typing import Literal, Mapping

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field

from tianji.algos.base import (
    NO_HOOK,
    AlgoSpec,
    Arrays,
    NetAndOptimizer,
    OnPolicyBatches,
    Placement,
    explained_variance,
    load_module_weights,
    resolve_device,
    to_device,
)
from tianji.algos.common.networks import PolicyValueNet, trunk_health
from tianji.algos.common.optim import GradientStep
from tianji.algos.common.returns import compute_gae
from tianji.algos.common.settings import (
    INIT_DESCRIPTION,
    MODEL_DESCRIPTION,
    ModelName,
    OptimizerConfig,
    TrainedConfig,
    adam_eps,
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
    value_clip: float | None = Field(None, gt=0, description="Clip the value prediction to within this distance of "
                                     "the actor's value estimate in the value loss (PPO2's value clipping; "
                                     "null: no clipping).")
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    normalize_advantages: bool = Field(True, description="Normalise advantages per minibatch.")
    batch_fragments: int = Field(1, ge=1, description="Fragments gathered into one training batch.")
    hidden: list[int] = Field(default_factory=lambda: [64, 64], description="Hidden layer sizes of the policy and value MLPs.")


class PPOConfig(SurrogateConfig):
    name: Literal["ppo"] = Field("ppo", description="Algorithm: proximal policy optimisation (on-policy).")
    lr: float = Field(3e-4, gt=0, description="Learning rate (the start of a schedule).")
    model: ModelName = Field("auto", description=MODEL_DESCRIPTION)
    init: Literal["default", "orthogonal"] = Field("default", description=INIT_DESCRIPTION)


def ppo_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    cfg: PPOConfig,
    old_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate + value loss - entropy bonus, each a mean over one minibatch of valid steps.

    With `cfg.value_clip` (and the actor's `old_values`), the value loss is the larger of the plain
    and the clipped squared error, the clipped prediction staying within value_clip of old_values.
    """
    if cfg.normalize_advantages and advantages.numel() > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - cfg.clip, 1 + cfg.clip))
    policy_loss = surrogate.mean()
    value_error = (new_values - returns).pow(2)
    if cfg.value_clip is not None and old_values is not None:
        clipped = old_values + (new_values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        value_error = torch.max(value_error, (clipped - returns).pow(2))
    value_loss = 0.5 * value_error.mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": entropy_mean.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_frac": ((ratio - 1).abs() > cfg.clip).float().mean(),
        }
    return loss, stats


# ------------------------------------------------------------------ network


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    """Raise ValueError unless PPO can take these spaces."""
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"PPO needs a Box observation space, got {obs_space}")
    if not isinstance(act_space, (gym.spaces.Discrete, gym.spaces.Box)):
        raise ValueError(f"PPO supports Discrete or Box action spaces, got {act_space}")


def make_net(cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space)
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model, cfg.init)


# ------------------------------------------------------------------ actor side


class PPOPolicy:
    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        self.net = make_net(cfg, obs_space, act_space)
        self.net.requires_grad_(False)
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
        return {"bootstrap_value": self.net.value(torch.from_numpy(last_obs)).numpy()}


# ------------------------------------------------------------------ learner side


class PPOLearner(OnPolicyBatches, NetAndOptimizer):
    def __init__(self, cfg: PPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        self.cfg = cfg
        self.device = resolve_device(device)
        self.net = make_net(cfg, obs_space, act_space).to(self.device)
        self.step = GradientStep.from_config(self.net.parameters(), cfg)
        self.optimizer = self.step.optimizer
        self.sync = NO_HOOK
        self.env_steps = 0
        self.pending: list[Mapping[str, np.ndarray]] = []

    def _batch(self) -> dict[str, torch.Tensor]:
        fragments = self.take_batch()
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "action", "logp", "value", "adv", "ret")}
        for f in fragments:
            adv, ret = compute_gae(
                f["reward"], f["value"], f["bootstrap_value"], f["done"], f["terminated"],
                self.cfg.gamma, self.cfg.gae_lambda,
            )
            valid = f["valid"].reshape(-1)
            for key, arr in (("obs", f["obs"]), ("action", f["action"]), ("logp", f["logp"]), ("value", f["value"]),
                             ("adv", adv), ("ret", ret)):
                parts[key].append(arr.reshape(valid.shape[0], *arr.shape[2:])[valid])
        return {k: to_device(np.concatenate(v), self.device) for k, v in parts.items()}

    def update(self) -> dict[str, float]:
        batch = self._batch()
        n = batch["adv"].shape[0]
        size = max(1, n // self.cfg.minibatches)
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.epochs):
            order = torch.randperm(n, device=self.device)
            for start in range(0, n - size + 1, size):
                idx = order[start : start + size]
                logp, entropy, value = self.net.evaluate(batch["obs"][idx], batch["action"][idx])
                loss, stats = ppo_loss(logp, batch["logp"][idx], batch["adv"][idx], value, batch["ret"][idx], entropy,
                                       self.cfg, batch["value"][idx])
                stats.update(self.step(loss, self.sync, self.env_steps))
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
                steps += 1
        stats = {k: v / max(steps, 1) for k, v in totals.items()}
        stats["explained_variance"] = explained_variance(batch["value"], batch["ret"])
        return {**stats, **trunk_health(self.net)}


SPEC = AlgoSpec("ppo", PPOConfig, PPOPolicy, PPOLearner, check_spaces)
