"""MAPPO (Yu et al., 2022) and IPPO for cooperative multi-agent envs (tianji.multiagent): one policy
shared by all agents (its observation and its id in, unavailable actions masked), PPO's clipped
surrogate, and a value function on the global state (MAPPO) or on each agent's own observation
(IPPO, `centralised_value: false`). The team reward's GAE is computed per env (MAPPO) or per agent
(IPPO) with the same `compute_gae` as PPO, and the same lag machinery applies.
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from tianji.algos.base import NO_HOOK, Arrays, Placement, load_module_weights, mlp, module_weights, resolve_device, to_device
from tianji.algos.ppo import compute_gae, ppo_loss
from tianji.algos.qmix import NEG, _sizes, check_spaces
from tianji.config import MAPPOConfig
from tianji.optim import Adam


class SharedActorCritic(nn.Module):
    def __init__(self, n_agents: int, obs_dim: int, n_actions: int, state_dim: int, hidden: list[int],
                 centralised_value: bool):
        super().__init__()
        self.n_agents, self.centralised = n_agents, centralised_value
        self.pi = mlp([obs_dim + n_agents, *hidden, n_actions])
        self.v = mlp([state_dim if centralised_value else obs_dim + n_agents, *hidden, 1])
        with torch.no_grad():
            self.pi[-1].weight.mul_(0.01)
            self.pi[-1].bias.zero_()

    def agent_inputs(self, obs: torch.Tensor) -> torch.Tensor:
        """[B, n, d] -> [B, n, d + n]: every agent sees its own id."""
        ids = torch.eye(self.n_agents, device=obs.device).expand(obs.shape[0], -1, -1)
        return torch.cat([obs.float(), ids], dim=-1)

    def logits(self, obs: torch.Tensor, avail: torch.Tensor) -> torch.Tensor:
        return self.pi(self.agent_inputs(obs)).masked_fill(~avail.bool(), NEG)

    def value(self, obs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[B] on the global state (MAPPO), or [B, n] on each agent's observation (IPPO)."""
        if self.centralised:
            return self.v(state.float()).squeeze(-1)
        return self.v(self.agent_inputs(obs)).squeeze(-1)


def make_net(cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space) -> SharedActorCritic:
    check_spaces(obs_space, act_space)
    n, obs_dim, n_actions, state_dim = _sizes(obs_space, act_space)
    return SharedActorCritic(n, obs_dim, n_actions, state_dim, cfg.hidden, cfg.centralised_value)


class MAPPOPolicy:
    def __init__(self, cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        self.net = make_net(cfg, obs_space, act_space)
        self.net.requires_grad_(False)
        self.rng = np.random.default_rng(torch.initial_seed() % (2**32))

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    @torch.no_grad()
    def act(self, obs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Arrays]:
        t = {key: torch.from_numpy(np.asarray(value)) for key, value in obs.items()}
        log_probs = torch.log_softmax(self.net.logits(t["obs"], t["avail_actions"]), dim=-1)
        action = torch.distributions.Categorical(logits=log_probs).sample()
        logp = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        value = self.net.value(t["obs"], t["state"])
        return action.numpy(), {"action": action.numpy(), "logp": logp.numpy(), "value": value.numpy()}

    @torch.no_grad()
    def greedy(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        logits = self.net.logits(torch.from_numpy(obs["obs"]), torch.from_numpy(obs["avail_actions"]))
        return logits.argmax(-1).numpy()

    @torch.no_grad()
    def finish_fragment(self, fragment: Arrays, last_obs: Mapping[str, np.ndarray]) -> Arrays:
        value = self.net.value(torch.from_numpy(last_obs["obs"]), torch.from_numpy(last_obs["state"]))
        return {"bootstrap_value": value.numpy()}


class MAPPOLearner:
    def __init__(self, cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        self.cfg = cfg
        self.device = resolve_device(device)
        self.net = make_net(cfg, obs_space, act_space).to(self.device)
        self.optimizer = Adam(self.net.parameters(), lr=cfg.lr, eps=1e-5)
        self.sync = NO_HOOK
        self.pending: list[Mapping[str, np.ndarray]] = []
        self._samples_per_fragment = 0

    def add(self, fragment: Mapping[str, np.ndarray]) -> None:
        self.pending.append(fragment)
        self._samples_per_fragment = int(fragment["reward"].size)

    def wants_data(self) -> bool:
        return len(self.pending) < self.cfg.batch_fragments

    def ready(self) -> bool:
        return len(self.pending) >= self.cfg.batch_fragments

    def samples_per_update(self) -> int:
        return self._samples_per_fragment * self.cfg.batch_fragments

    def _advantages(self, f: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """GAE of the team reward per env (values [T, k]) or per agent (values [T, k, n]); -> [T, k, n]."""
        T, k, n = f["action"].shape
        values = f["value"]
        if values.ndim == 2:
            adv, ret = compute_gae(f["reward"], values, f["bootstrap_value"], f["done"], f["terminated"],
                                   self.cfg.gamma, self.cfg.gae_lambda)
            return np.repeat(adv[..., None], n, -1), np.repeat(ret[..., None], n, -1)
        per_agent = [np.repeat(f[key][..., None], n, -1).reshape(T, k * n) for key in ("reward", "done", "terminated")]
        adv, ret = compute_gae(per_agent[0], values.reshape(T, k * n), f["bootstrap_value"].reshape(k * n),
                               per_agent[1], per_agent[2], self.cfg.gamma, self.cfg.gae_lambda)
        return adv.reshape(T, k, n), ret.reshape(T, k, n)

    def _batch(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        fragments, self.pending = self.pending[: c.batch_fragments], self.pending[c.batch_fragments:]
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "state", "avail_actions", "action", "logp", "adv",
                                                               "ret", "mask")}
        for f in fragments:
            T, k, n = f["action"].shape
            adv, ret = self._advantages(f)
            mask = f["valid"][..., None] & f["active"].astype(bool)  # agent-steps that count
            for key, value in (("obs", f["obs"]), ("state", f["state"]), ("avail_actions", f["avail_actions"]),
                               ("action", f["action"]), ("logp", f["logp"]), ("adv", adv), ("ret", ret),
                               ("mask", mask)):
                parts[key].append(value.reshape(T * k, *value.shape[2:]))
        return {key: to_device(np.concatenate(value), self.device) for key, value in parts.items()}

    def update(self) -> dict[str, float]:
        c = self.cfg
        b = self._batch()
        rows = b["adv"].shape[0]
        size = max(1, rows // c.minibatches)
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(c.epochs):
            order = torch.randperm(rows, device=self.device)
            for start in range(0, rows - size + 1, size):
                idx = order[start:start + size]
                mask = b["mask"][idx].bool()
                log_probs = torch.log_softmax(self.net.logits(b["obs"][idx], b["avail_actions"][idx]), dim=-1)
                logp = log_probs.gather(-1, b["action"][idx].long().unsqueeze(-1)).squeeze(-1)
                probs = log_probs.exp()
                entropy = -(probs * log_probs.clamp(min=NEG / 2)).sum(-1)
                value = self.net.value(b["obs"][idx], b["state"][idx])
                if value.dim() == 1:  # a centralised value, one per env: the same for every agent
                    value = value.unsqueeze(-1).expand_as(logp)
                loss, stats = ppo_loss(logp[mask], b["logp"][idx][mask], b["adv"][idx][mask], value[mask],
                                       b["ret"][idx][mask], entropy[mask], c)
                self.optimizer.zero_grad()
                loss.backward()
                self.sync.gradients(self.optimizer.params)
                stats["grad_norm"] = nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm).detach()
                self.optimizer.step()
                for key, value_ in stats.items():
                    totals[key] = totals.get(key, 0.0) + float(value_)
                steps += 1
        return {key: value / max(steps, 1) for key, value in totals.items()}

    def weights(self) -> Arrays:
        return module_weights(self.net)

    def parameters(self) -> list[torch.Tensor]:
        return self.optimizer.params

    def optimizer_moments(self) -> list[torch.Tensor]:
        return self.optimizer.moments()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])

