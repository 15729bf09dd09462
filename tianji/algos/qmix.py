"""QMIX (Rashid et al., 2018) for cooperative multi-agent envs (tianji.envs.multiagent): one recurrent agent
network shared by all agents (its observation, its last action and its id in, a GRU, Q-values out),
and a monotonic mixing network whose weights come from hypernetworks of the global state.

Learning needs sequences: every fragment is stored as k sequences of T steps (one per env) with the
agent network's hidden state at their start; the learner samples batches of them, unrolls the
agent network from that state (resetting it where an episode starts), and regresses Q_tot on
TD(lambda) targets of a target network, double-Q style. Unavailable actions are masked when acting
and in the targets. The pure pieces (`Mixer`, `td_lambda_targets`, `masked_argmax`, `double_q_next`) are tested
against references.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field
from torch import nn

from tianji.algos.base import AlgoSpec, Placement
from tianji.algos.common.multiagent import UNAVAILABLE, check_multiagent_spaces, team_sizes
from tianji.algos.common.optim import NO_HOOK, GradientHook, GradientStep
from tianji.algos.common.replay import SequenceReplay
from tianji.algos.common.returns import td_lambda_targets
from tianji.algos.common.settings import TrainedConfig
from tianji.algos.common.tensors import Arrays, load_module_weights, module_weights, resolve_device, to_device


class QMIXConfig(TrainedConfig):
    name: Literal["qmix"] = Field(
        "qmix",
        description="Algorithm: QMIX, value decomposition for cooperative "
        "multi-agent envs (recurrent agents, monotonic mixer; off-policy).",
    )
    measures_kl: ClassVar[bool] = False
    lr: float = Field(5e-4, gt=0, description="Learning rate (the start of a schedule).")
    gamma: float = Field(0.99, ge=0, le=1, description="Discount factor.")
    td_lambda: float = Field(0.6, ge=0, le=1, description="TD(lambda) of the targets (0: one-step targets).")
    rnn_hidden: int = Field(64, ge=1, description="Width of the agent network's GRU.")
    mixer_embed: int = Field(32, ge=1, description="Width of the mixing network.")
    batch_sequences: int = Field(32, ge=1, description="Sequences (one env's fragment each) per gradient step.")
    buffer_sequences: int = Field(5000, ge=1, description="Replay capacity in sequences.")
    learning_starts_sequences: int = Field(64, ge=0, description="Sequences in replay before training starts.")
    target_update_interval: int = Field(200, ge=1, description="Updates between copies into the target networks.")
    max_grad_norm: float = Field(10.0, gt=0, description="Global gradient-norm clip.")
    epsilon_start: float = Field(1.0, ge=0, le=1, description="Exploration: starting epsilon.")
    epsilon: float = Field(0.05, ge=0, le=1, description="Exploration: final epsilon.")
    epsilon_decay_steps: int = Field(50_000, ge=1, description="Env steps (per actor) over which epsilon anneals.")


# ------------------------------------------------------------------ pure pieces


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    check_multiagent_spaces(obs_space, act_space, "QMIX")


def masked_argmax(q: torch.Tensor, avail: torch.Tensor) -> torch.Tensor:
    """Greedy action among the available ones (`avail` bool, same shape as `q`)."""
    return q.masked_fill(~avail, UNAVAILABLE).argmax(dim=-1)


def double_q_next(q_online: torch.Tensor, q_target: torch.Tensor, avail: torch.Tensor) -> torch.Tensor:
    """Double Q: the target network's value of the action the online network picks among the
    available ones (an unavailable action never enters a target)."""
    return q_target.gather(-1, masked_argmax(q_online, avail).unsqueeze(-1)).squeeze(-1)


class AgentRNN(nn.Module):
    """Q-values of one agent from its observation, its last action and its id, with a GRU memory."""

    def __init__(self, obs_dim: int, n_agents: int, n_actions: int, hidden: int):
        super().__init__()
        self.n_agents, self.n_actions, self.hidden = n_agents, n_actions, hidden
        self.fc = nn.Linear(obs_dim + n_actions + n_agents, hidden)
        self.gru = nn.GRUCell(hidden, hidden)
        self.q = nn.Linear(hidden, n_actions)

    def inputs(self, obs: torch.Tensor, last_action: torch.Tensor) -> torch.Tensor:
        """[B, n, obs] and [B, n] last actions (-1: none) -> [B, n, obs + A + n]."""
        batch = obs.shape[0]
        last = nn.functional.one_hot(last_action.clamp(min=0).long(), self.n_actions).float()
        last = last * (last_action >= 0).unsqueeze(-1).float()
        ids = torch.eye(self.n_agents, device=obs.device).expand(batch, -1, -1)
        return torch.cat([obs.float(), last, ids], dim=-1)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, in], h [B, n, H] -> Q [B, n, A], new h."""
        batch, n = x.shape[:2]
        h = self.gru(torch.relu(self.fc(x.reshape(batch * n, -1))), h.reshape(batch * n, -1))
        return self.q(h).reshape(batch, n, -1), h.reshape(batch, n, -1)


class Mixer(nn.Module):
    """Q_tot(q_1..q_n, s), monotonic in every q_i: the hypernetworks' weights pass through |.|."""

    def __init__(self, n_agents: int, state_dim: int, embed: int = 32, hyper: int = 64):
        super().__init__()
        self.n_agents, self.embed = n_agents, embed
        self.w1 = nn.Sequential(nn.Linear(state_dim, hyper), nn.ReLU(), nn.Linear(hyper, n_agents * embed))
        self.b1 = nn.Linear(state_dim, embed)
        self.w2 = nn.Sequential(nn.Linear(state_dim, hyper), nn.ReLU(), nn.Linear(hyper, embed))
        self.v = nn.Sequential(nn.Linear(state_dim, embed), nn.ReLU(), nn.Linear(embed, 1))

    def forward(self, q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """q [B, n], state [B, s] -> Q_tot [B]."""
        w1 = self.w1(state).abs().view(-1, self.n_agents, self.embed)
        hidden = nn.functional.elu(torch.bmm(q.unsqueeze(1), w1).squeeze(1) + self.b1(state))
        w2 = self.w2(state).abs()
        return (hidden * w2).sum(-1) + self.v(state).squeeze(-1)


# ------------------------------------------------------------------ actor side


class QMIXPolicy:
    """Epsilon-greedy over available actions with the agent network; keeps each env's hidden state
    and last actions across fragments, and records what the learner needs to replay them."""

    def __init__(self, cfg: QMIXConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        check_spaces(obs_space, act_space)
        self.cfg = cfg
        n, obs_dim, self.n_actions, _ = team_sizes(obs_space, act_space)
        self.net = AgentRNN(obs_dim, n, self.n_actions, cfg.rnn_hidden)
        self.net.requires_grad_(False)
        self.rng = np.random.default_rng(torch.initial_seed() % (2**32))
        self.steps = 0
        self.h: torch.Tensor | None = None
        self.last_action: np.ndarray | None = None
        self.h0: np.ndarray | None = None  # at the start of the fragment being collected

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    def epsilon(self) -> float:
        c = self.cfg
        frac = min(1.0, self.steps / c.epsilon_decay_steps)
        return c.epsilon_start + frac * (c.epsilon - c.epsilon_start)

    @torch.no_grad()
    def _q(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        k, n = obs["obs"].shape[:2]
        if self.h is None:
            self.h = torch.zeros(k, n, self.net.hidden)
            self.last_action = np.full((k, n), -1, np.int64)
        assert self.h is not None and self.last_action is not None
        first = obs["first"].reshape(k).astype(bool)
        self.h[torch.from_numpy(first)] = 0.0  # a new episode: no memory, no last action
        self.last_action[first] = -1
        if self.h0 is None:
            self.h0 = self.h.numpy().copy()
        x = self.net.inputs(torch.from_numpy(obs["obs"]), torch.from_numpy(self.last_action))
        q, self.h = self.net(x, self.h)
        return q.numpy()

    def act(self, obs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Arrays]:
        q = self._q(obs)  # resets the memory and last actions of envs that start an episode
        assert self.last_action is not None
        last = self.last_action.copy()
        avail = obs["avail_actions"].astype(bool)
        greedy = np.where(avail, q, UNAVAILABLE).argmax(-1)
        random = _random_available(avail, self.rng)
        explore = self.rng.random(greedy.shape) < self.epsilon()
        action = np.where(explore, random, greedy)
        self.last_action = action
        self.steps += action.shape[0]
        return action, {"action": action, "last_action": last}

    def greedy(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        q = self._q(obs)
        action = np.where(obs["avail_actions"].astype(bool), q, UNAVAILABLE).argmax(-1)
        self.last_action = action
        return action

    def finish_fragment(self, fragment: Arrays, last_obs: Mapping[str, np.ndarray]) -> Arrays:
        assert self.h is not None and self.h0 is not None and self.last_action is not None  # a fragment was collected
        h0, self.h0 = self.h0, self.h.numpy().copy()  # the next fragment starts where this one ended
        return {
            "h0": h0,
            **{f"next_{key}": np.asarray(value) for key, value in last_obs.items()},
            "next_last_action": np.where(last_obs["first"].reshape(-1, 1), -1, self.last_action),
        }


def _random_available(avail: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random available action per agent (avail [..., A] bool, at least one True)."""
    scores = rng.random(avail.shape) * avail
    return scores.argmax(-1)


# ------------------------------------------------------------------ learner side


TIME_MAJOR = {
    "obs",
    "state",
    "avail_actions",
    "active",
    "first",
    "action",
    "last_action",
    "reward",
    "terminated",
    "done",
    "valid",
    "won",
}


class QMIXLearner:
    def __init__(self, cfg: QMIXConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        check_spaces(obs_space, act_space)
        self.cfg = cfg
        self.device = resolve_device(device)
        n, obs_dim, n_actions, state_dim = team_sizes(obs_space, act_space)
        self.agent = AgentRNN(obs_dim, n, n_actions, cfg.rnn_hidden).to(self.device)
        self.mixer = Mixer(n, state_dim, cfg.mixer_embed).to(self.device)
        self.target_agent = AgentRNN(obs_dim, n, n_actions, cfg.rnn_hidden).to(self.device)
        self.target_mixer = Mixer(n, state_dim, cfg.mixer_embed).to(self.device)
        self._sync_targets()
        self.step = GradientStep.from_config([*self.agent.parameters(), *self.mixer.parameters()], cfg)
        self.optimizer = self.step.optimizer
        self.sync: GradientHook = NO_HOOK
        self.env_steps = 0
        self.replay = SequenceReplay(cfg.buffer_sequences)
        self.rng = np.random.default_rng(torch.initial_seed() % (2**32))
        self.updates = 0
        self._steps_per_sequence = 1

    def _sync_targets(self) -> None:
        self.target_agent.load_state_dict(self.agent.state_dict())
        self.target_mixer.load_state_dict(self.mixer.state_dict())

    def add(self, fragment: Mapping[str, np.ndarray]) -> None:
        self._steps_per_sequence = fragment["reward"].shape[0]
        self.replay.add(fragment, TIME_MAJOR)

    def wants_data(self) -> bool:
        return True  # the runtime's rate limiter balances insertion against training

    def ready(self) -> bool:
        return len(self.replay) >= max(self.cfg.learning_starts_sequences, self.cfg.batch_sequences)

    def samples_per_update(self) -> int:
        return self.cfg.batch_sequences * self._steps_per_sequence

    def _unroll(self, net: AgentRNN, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """Q [T + 1, B, n, A]: the agent network over each sequence and the step after it, from the
        stored hidden state, reset where an episode starts."""
        obs = torch.cat([b["obs"], b["next_obs"].unsqueeze(1)], dim=1)  # [B, T + 1, n, d]
        last = torch.cat([b["last_action"], b["next_last_action"].unsqueeze(1)], dim=1)
        first = torch.cat([b["first"], b["next_first"].unsqueeze(1)], dim=1).reshape(obs.shape[0], obs.shape[1])
        h = b["h0"].float()
        qs = []
        for t in range(obs.shape[1]):
            h = h * (~first[:, t].bool()).float().view(-1, 1, 1)
            q, h = net(net.inputs(obs[:, t], last[:, t]), h)
            qs.append(q)
        return torch.stack(qs)

    def update(self) -> dict[str, float]:
        c = self.cfg
        b = {k: to_device(v, self.device) for k, v in self.replay.sample(c.batch_sequences, self.rng).items()}
        q = self._unroll(self.agent, b)  # [T + 1, B, n, A]
        with torch.no_grad():
            q_target = self._unroll(self.target_agent, b)
        T = b["reward"].shape[1]
        actions = b["action"].transpose(0, 1).long()  # [T, B, n]
        chosen = q[:T].gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        states = b["state"].transpose(0, 1)  # [T, B, s]
        next_states = torch.cat([states[1:], b["next_state"].unsqueeze(0)])
        avail = torch.cat([b["avail_actions"].transpose(0, 1), b["next_avail_actions"].unsqueeze(0)]).bool()
        q_tot = self.mixer(chosen.reshape(-1, chosen.shape[-1]), states.reshape(-1, states.shape[-1])).view(T, -1)
        with torch.no_grad():
            next_q = double_q_next(q[1:].detach(), q_target[1:], avail[1:])  # [T, B, n]
            next_q_tot = self.target_mixer(
                next_q.reshape(-1, next_q.shape[-1]), next_states.reshape(-1, next_states.shape[-1])
            ).view(T, -1)
            targets = td_lambda_targets(
                b["reward"].transpose(0, 1).float(),
                next_q_tot,
                next_q_tot[-1],
                b["done"].transpose(0, 1),
                b["terminated"].transpose(0, 1),
                c.gamma,
                c.td_lambda,
            )
        valid = b["valid"].transpose(0, 1).float()
        td = (q_tot - targets) * valid
        loss = td.pow(2).sum() / valid.sum().clamp(min=1.0)
        step = self.step(loss, self.sync, self.env_steps)
        self.updates += 1
        if self.updates % c.target_update_interval == 0:
            self._sync_targets()
        return {
            "loss": float(loss.detach()),
            "q_tot_mean": float((q_tot.detach() * valid).sum() / valid.sum().clamp(min=1.0)),
            "grad_norm": float(step["grad_norm"]),
            "lr": float(step["lr"]),
            "replay_sequences": float(len(self.replay)),
        }

    def weights(self) -> Arrays:
        return module_weights(self.agent)

    def parameters(self) -> list[torch.Tensor]:
        return self.optimizer.params

    def optimizer_moments(self) -> list[torch.Tensor]:
        return self.optimizer.moments()

    def state_dict(self) -> dict[str, Any]:
        return {
            "net": self.agent.state_dict(),
            "mixer": self.mixer.state_dict(),
            "target_agent": self.target_agent.state_dict(),
            "target_mixer": self.target_mixer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agent.load_state_dict(state["net"])
        self.mixer.load_state_dict(state["mixer"])
        self.target_agent.load_state_dict(state["target_agent"])
        self.target_mixer.load_state_dict(state["target_mixer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


SPEC = AlgoSpec("qmix", QMIXConfig, QMIXPolicy, QMIXLearner, check_spaces)
