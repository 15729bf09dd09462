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
from torch import nn

from tianji.algos.base import NO_HOOK, NetAndOptimizer, OnPolicyBatches, Arrays, resolve_device, to_device
from tianji.algos.networks import PolicyValueNet
from tianji.algos.ppo import PPOPolicy, check_spaces
from tianji.algos.vtrace import vtrace
from tianji.config import IMPALAConfig
from tianji.optim import Adam


def impala_loss(target_logp: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor, vs: torch.Tensor,
                entropy: torch.Tensor, cfg: IMPALAConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient with V-trace advantages, value regression to v_s, entropy bonus (valid steps)."""
    policy_loss = -(advantages.detach() * target_logp).mean()
    value_loss = 0.5 * (vs.detach() - values).pow(2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
    return loss, {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                  "entropy": entropy_mean.detach()}


def make_net(cfg: IMPALAConfig, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space)
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model)


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
        self.optimizer = Adam(self.net.parameters(), lr=cfg.lr)
        self.sync = NO_HOOK
        self.pending: list[Mapping[str, np.ndarray]] = []

    def _tensor(self, key: str, fragments: list[Mapping[str, np.ndarray]], axis: int = 1) -> torch.Tensor:
        """Fragments side by side on the env axis ([T, k1 + k2, ...]); uint8 stays uint8 until the net."""
        array = np.concatenate([f[key] for f in fragments], axis=axis) if len(fragments) > 1 else fragments[0][key]
        return to_device(array, self.device)

    def update(self) -> dict[str, float]:
        c = self.cfg
        fragments = self.take_batch()
        obs, action = self._tensor("obs", fragments), self._tensor("action", fragments)
        T, k = action.shape[:2]
        logp, entropy, values = self.net.evaluate(obs.reshape(T * k, *obs.shape[2:]), action.reshape(T * k, *action.shape[2:]))
        logp, entropy, values = logp.reshape(T, k), entropy.reshape(T, k), values.reshape(T, k)
        with torch.no_grad():
            bootstrap = self.net.value(self._tensor("last_obs", fragments, axis=0))
        vs, advantages = vtrace(self._tensor("logp", fragments), logp.detach(), self._tensor("reward", fragments).float(),
                                values.detach(), bootstrap, self._tensor("done", fragments),
                                self._tensor("terminated", fragments), c.gamma, c.vtrace_lambda, c.rho_bar, c.c_bar)
        valid = self._tensor("valid", fragments).bool()
        loss, stats = impala_loss(logp[valid], advantages[valid], values[valid], vs[valid], entropy[valid], c)
        self.optimizer.zero_grad()
        loss.backward()
        self.sync.gradients(self.optimizer.params)
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            stats["rho_mean"] = (logp.detach() - self._tensor("logp", fragments)).exp()[valid].mean()
        return {key: float(value) for key, value in stats.items()}
