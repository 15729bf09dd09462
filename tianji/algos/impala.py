"""IMPALA (Espeholt et al., 2018): actor-critic trained in one pass on fragments made by older
policies, corrected by V-trace (`tianji.algos.vtrace`). The algorithm that tolerates lag.

The loss (`impala_loss`) is pure and tested; `IMPALAPolicy` runs in actors (it records the
behaviour log-probs and the observation after the fragment), `IMPALALearner` in the learner,
which recomputes values and target log-probs with its current parameters.
"""

from __future__ import annotations

from typing import Mapping

import gymnasium as gym
import numpy as np
import torch

from tianji.algos.base import NO_HOOK, Arrays, NetAndOptimizer, OnPolicyBatches, explained_variance, resolve_device, to_device
from tianji.algos.networks import PolicyValueNet
from tianji.algos.ppo import PPOPolicy, check_spaces
from tianji.algos.vtrace import vtrace
from tianji.config import IMPALAConfig
from tianji.optim import GradientStep, lr_schedule, make_optimizer


def impala_loss(target_logp: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor, vs: torch.Tensor,
                entropy: torch.Tensor, cfg: IMPALAConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient with V-trace advantages, value regression to v_s, entropy bonus: each a mean over
    the batch's valid steps (the IMPALA paper sums them; see tianji.optim for the equivalent settings)."""
    policy_loss = -(advantages.detach() * target_logp).mean()
    value_loss = 0.5 * (vs.detach() - values).pow(2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    return loss, {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                  "entropy": entropy_mean.detach()}


def make_net(cfg: IMPALAConfig, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space)
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model, cfg.init)


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


class IMPALALearner(OnPolicyBatches, NetAndOptimizer):
    def __init__(self, cfg: IMPALAConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        self.cfg = cfg
        self.device = resolve_device(device)
        self.net = make_net(cfg, obs_space, act_space).to(self.device)
        self.optimizer = make_optimizer(self.net.parameters(), cfg.optimizer, cfg.lr)
        self.step = GradientStep(self.optimizer, cfg.max_grad_norm, lr_schedule(cfg.lr_schedule, cfg.lr_horizon))
        self.sync = NO_HOOK
        self.env_steps = 0
        self.pending: list[Mapping[str, np.ndarray]] = []

    def _tensor(self, key: str, fragments: list[Mapping[str, np.ndarray]], axis: int = 1) -> torch.Tensor:
        """Fragments side by side on the env axis ([T, k1 + k2, ...]); uint8 stays uint8 until the net."""
        array = np.concatenate([f[key] for f in fragments], axis=axis) if len(fragments) > 1 else fragments[0][key]
        return to_device(array, self.device)

    def update(self) -> dict[str, float]:
        c = self.cfg
        fragments = self.take_batch()
        obs, action = self._tensor("obs", fragments), self._tensor("action", fragments)
        behaviour_logp = self._tensor("logp", fragments)
        T, k = action.shape[:2]
        logp, entropy, values = self.net.evaluate(obs.reshape(T * k, *obs.shape[2:]), action.reshape(T * k, *action.shape[2:]))
        logp, entropy, values = logp.reshape(T, k), entropy.reshape(T, k), values.reshape(T, k)
        with torch.no_grad():
            bootstrap = self.net.value(self._tensor("last_obs", fragments, axis=0))
        vs, advantages = vtrace(behaviour_logp, logp.detach(), self._tensor("reward", fragments).float(),
                                values.detach(), bootstrap, self._tensor("done", fragments),
                                self._tensor("terminated", fragments), c.gamma, c.vtrace_lambda, c.rho_bar, c.c_bar)
        valid = self._tensor("valid", fragments).bool()
        loss, stats = impala_loss(logp[valid], advantages[valid], values[valid], vs[valid], entropy[valid], c)
        stats.update(self.step(loss, self.sync, self.env_steps))
        stats.update(vtrace_diagnostics(behaviour_logp[valid], logp.detach()[valid], c.rho_bar))
        stats["explained_variance"] = explained_variance(values.detach()[valid], vs[valid])
        return {key: float(value) for key, value in stats.items()}


def vtrace_diagnostics(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the learner's policy is from the actors': the mean importance weight pi/mu, the share
    of weights V-trace truncates at rho_bar, and the KL(mu || pi) estimate (r - 1) - log r."""
    log_ratio = target_logp - behaviour_logp
    ratio = log_ratio.exp()
    return {"rho_mean": float(ratio.mean()), "rho_clipped": float((ratio > rho_bar).float().mean()),
            "approx_kl": float(((ratio - 1) - log_ratio).mean())}
