"""DQN family with Ape-X actors: double Q, dueling heads, n-step returns, target network, Huber loss,
prioritized replay owned by the learner, and initial priorities computed by the actors.

The math (`nstep_transitions`, `double_q_targets`, `td_loss`, `epsilon_ladder`) is pure and tested
against hand-computed references. `DQNPolicy` runs in actors, `DQNLearner` in the learner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field
from torch import nn

from tianji.algos.base import AlgoSpec, NetAndOptimizer, Placement
from tianji.algos.common.networks import make_trunk, shape_of
from tianji.algos.common.optim import NO_HOOK, GradientHook, GradientStep
from tianji.algos.common.replay import PrioritizedReplay
from tianji.algos.common.returns import nstep_transitions
from tianji.algos.common.settings import (
    MODEL_DESCRIPTION,
    ConvLayers,
    ModelName,
    TrainedConfig,
    conv_features_field,
    conv_field,
)
from tianji.algos.common.tensors import Arrays, load_module_weights, resolve_device, to_device

# ------------------------------------------------------------------ pure math


class DQNConfig(TrainedConfig):
    name: Literal["dqn"] = Field(
        "dqn", description="Algorithm: DQN family with Ape-X style prioritized replay (off-policy)."
    )
    measures_kl: ClassVar[bool] = False
    lr: float = Field(1e-3, gt=0, description="Learning rate (the start of a schedule).")
    gamma: float = Field(0.99, ge=0, le=1, description="Discount factor.")
    n_step: int = Field(3, ge=1, description="Steps in the n-step return (built actor-side).")
    double: bool = Field(
        True, description="Double Q-learning: online net picks the bootstrap action, target net values it."
    )
    dueling: bool = Field(True, description="Dueling value/advantage heads.")
    hidden: list[int] = Field(default_factory=lambda: [128, 128], description="Hidden layer sizes of the Q-network.")
    model: ModelName = Field("auto", description=MODEL_DESCRIPTION)
    conv: ConvLayers | None = conv_field()
    conv_features: int | None = conv_features_field()
    batch_size: int = Field(128, ge=1, description="Transitions per gradient step.")
    buffer_capacity: int = Field(100_000, ge=1, description="Replay capacity in transitions.")
    learning_starts: int = Field(1_000, ge=0, description="Transitions in replay before training starts.")
    target_update_interval: int = Field(
        250, ge=1, description="Hard target-network update every N updates (when target_tau is 1)."
    )
    target_tau: float = Field(1.0, gt=0, le=1, description="Polyak factor per update; 1 means periodic hard updates.")
    max_grad_norm: float = Field(10.0, gt=0, description="Global gradient-norm clip.")
    prioritized: bool = Field(
        True, description="Proportional prioritized replay (priorities from actors, then TD errors)."
    )
    priority_alpha: float = Field(0.6, ge=0, description="Priority exponent.")
    beta_start: float = Field(0.4, ge=0, le=1, description="Importance-weight exponent at the start, annealed to 1.")
    beta_anneal_updates: int = Field(20_000, ge=1, description="Updates over which beta anneals to 1.")
    exploration: Literal["ladder", "linear"] = Field(
        "ladder",
        description="ladder: fixed per-env epsilon_i = epsilon**(1 + epsilon_alpha*i/(N-1)) over all envs "
        "of all actors (Ape-X); linear: each actor anneals from epsilon_start to epsilon over its own steps.",
    )
    epsilon: float = Field(
        0.4, ge=0, le=1, description="Ladder base epsilon, or the final epsilon of the linear schedule."
    )
    epsilon_alpha: float = Field(7.0, ge=0, description="Ladder exponent alpha.")
    epsilon_start: float = Field(1.0, ge=0, le=1, description="Linear schedule: starting epsilon.")
    epsilon_decay_steps: int = Field(
        10_000, ge=1, description="Linear schedule: env steps (per actor) to reach epsilon."
    )


def epsilon_ladder(index: int, count: int, base: float, alpha: float) -> float:
    """Ape-X exploration ladder: epsilon_i = base ** (1 + alpha * i / (count - 1))."""
    if count <= 1:
        return base
    return base ** (1 + alpha * index / (count - 1))


def double_q_targets(
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    next_q_online: torch.Tensor,
    next_q_target: torch.Tensor,
    double: bool,
) -> torch.Tensor:
    """r + discount * Q_target(s', a*), a* from the online net (double Q) or the target net."""
    if double:
        best = next_q_online.argmax(dim=-1, keepdim=True)
        bootstrap = next_q_target.gather(-1, best).squeeze(-1)
    else:
        bootstrap = next_q_target.max(dim=-1).values
    return rewards + discounts * bootstrap


def td_loss(q_taken: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance-weighted Huber loss and the TD errors (for new priorities)."""
    td = targets.detach() - q_taken
    loss = (weights * nn.functional.smooth_l1_loss(q_taken, targets.detach(), reduction="none")).mean()
    return loss, td.detach()


# ------------------------------------------------------------------ network


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    """Raise ValueError unless DQN can take these spaces."""
    if not isinstance(act_space, gym.spaces.Discrete):
        raise ValueError(f"DQN needs a Discrete action space, got {act_space}")
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"DQN needs a Box observation space, got {obs_space}")


class QNetwork(nn.Module):
    def __init__(
        self,
        obs_space: gym.Space,
        act_space: gym.Space,
        hidden: list[int],
        dueling: bool,
        model: str,
        conv: list[tuple[int, int, int]] | None = None,
        conv_features: int | None = None,
    ):
        super().__init__()
        check_spaces(obs_space, act_space)
        assert isinstance(act_space, gym.spaces.Discrete)
        n_actions = int(act_space.n)
        self.dueling = dueling
        self.trunk, width = make_trunk(obs_space, hidden, model, nn.ReLU, conv, conv_features)
        self.advantage = nn.Linear(width, n_actions)
        self.value = nn.Linear(width, 1) if dueling else None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.trunk(obs)
        adv = self.advantage(x)
        if self.value is None:
            return adv
        return self.value(x) + adv - adv.mean(dim=-1, keepdim=True)


def _make_net(cfg: DQNConfig, obs_space: gym.Space, act_space: gym.Space) -> QNetwork:
    return QNetwork(obs_space, act_space, cfg.hidden, cfg.dueling, cfg.model, cfg.conv, cfg.conv_features)


# ------------------------------------------------------------------ actor side


class DQNPolicy:
    """Epsilon-greedy inference; builds n-step transitions and their initial priorities actor-side."""

    def __init__(self, cfg: DQNConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        self.cfg = cfg
        self.net = _make_net(cfg, obs_space, act_space)
        self.net.requires_grad_(False)
        assert isinstance(act_space, gym.spaces.Discrete)  # check_spaces made sure
        self.n_actions = int(act_space.n)
        self.rng = np.random.default_rng(torch.initial_seed() % (2**32))
        self.steps = 0
        # this actor's rungs of the ladder that spans every env of every actor
        k = placement.envs_per_actor
        total = placement.num_actors * k
        first = placement.actor_id * k
        self.ladder = np.array([epsilon_ladder(first + j, total, cfg.epsilon, cfg.epsilon_alpha) for j in range(k)])

    def current_epsilon(self) -> np.ndarray:
        c = self.cfg
        if c.exploration == "linear":  # actor-local schedule: nothing shared through the learner
            frac = min(1.0, self.steps / (len(self.ladder) * c.epsilon_decay_steps))
            return np.full(len(self.ladder), c.epsilon_start + frac * (c.epsilon - c.epsilon_start))
        return self.ladder

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, Arrays]:
        q = self.net(torch.from_numpy(obs)).numpy()
        greedy = q.argmax(axis=1)
        explore = self.rng.random(len(q)) < self.current_epsilon()
        action = np.where(explore, self.rng.integers(0, self.n_actions, len(q)), greedy)
        self.steps += len(q)
        rows = np.arange(len(q))
        return action, {
            "action": action,
            "q_taken": q[rows, action].astype(np.float32),
            "q_max": q.max(axis=1).astype(np.float32),
        }

    @torch.no_grad()
    def greedy(self, obs: np.ndarray) -> np.ndarray:
        return self.net(torch.from_numpy(obs)).argmax(dim=1).numpy()

    @torch.no_grad()
    def finish_fragment(self, fragment: Arrays, last_obs: np.ndarray) -> Arrays:
        """Replace per-step rows by n-step transitions with initial priorities from our own Q-values."""
        c = self.cfg
        returns, discounts, steps = nstep_transitions(
            fragment["reward"], fragment["terminated"], fragment["done"], fragment["valid"], c.gamma, c.n_step
        )
        T, k = returns.shape
        all_obs = np.concatenate([fragment["obs"], last_obs[None]], axis=0)
        last_q_max = self.net(torch.from_numpy(last_obs)).max(dim=1).values.numpy()
        all_q_max = np.concatenate([fragment["q_max"], last_q_max[None]], axis=0)
        next_rows = np.arange(T)[:, None] + steps
        cols = np.arange(k)[None, :]
        priority = np.abs(returns + discounts * all_q_max[next_rows, cols] - fragment["q_taken"])
        return {
            "nstep_return": returns,
            "discount": discounts,
            "next_obs": all_obs[next_rows, cols],
            "priority": priority.astype(np.float32),
        }


# ------------------------------------------------------------------ learner side


class DQNLearner(NetAndOptimizer[nn.Module]):
    def __init__(self, cfg: DQNConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        self.cfg = cfg
        self.device = resolve_device(device)
        self.net = _make_net(cfg, obs_space, act_space).to(self.device)
        self.target = _make_net(cfg, obs_space, act_space).to(self.device)
        self.target.load_state_dict(self.net.state_dict())
        self.target.requires_grad_(False)
        self.step = GradientStep.from_config(self.net.parameters(), cfg)
        self.sync: GradientHook = NO_HOOK
        self.env_steps = 0
        self.replay = PrioritizedReplay(
            cfg.buffer_capacity,
            {
                "obs": (shape_of(obs_space), np.dtype(obs_space.dtype)),
                "next_obs": (shape_of(obs_space), np.dtype(obs_space.dtype)),
                "action": ((), np.dtype(np.int64)),
                "nstep_return": ((), np.dtype(np.float32)),
                "discount": ((), np.dtype(np.float32)),
            },
            alpha=cfg.priority_alpha if cfg.prioritized else 0.0,
        )
        self.rng = np.random.default_rng(torch.initial_seed() % (2**32))
        self.updates = 0

    def add(self, fragment: Mapping[str, np.ndarray]) -> None:
        valid = fragment["valid"].reshape(-1)
        flat = {
            k: v.reshape(valid.shape[0], *v.shape[2:])[valid]
            for k, v in fragment.items()
            if k in self.replay.data or k == "priority"
        }
        priority = flat.pop("priority") if self.cfg.prioritized else None
        self.replay.add(flat, priority)

    def wants_data(self) -> bool:
        return True  # the runtime's rate limiter balances insertion against training

    def ready(self) -> bool:
        return len(self.replay) >= max(self.cfg.learning_starts, self.cfg.batch_size)

    def samples_per_update(self) -> int:
        return self.cfg.batch_size

    def _beta(self) -> float:
        c = self.cfg
        frac = min(1.0, self.updates / max(1, c.beta_anneal_updates))
        return c.beta_start + frac * (1.0 - c.beta_start)

    def update(self) -> dict[str, float]:
        c = self.cfg
        idx, batch, weights = self.replay.sample(c.batch_size, self._beta(), self.rng)
        t = {k: to_device(v, self.device) for k, v in batch.items()}
        q = self.net(torch.cat([t["obs"], t["next_obs"]])) if c.double else self.net(t["obs"])
        q_obs = q[: c.batch_size]
        with torch.no_grad():
            next_q_target = self.target(t["next_obs"])
            next_q_online = q[c.batch_size :].detach() if c.double else next_q_target
            targets = double_q_targets(t["nstep_return"], t["discount"], next_q_online, next_q_target, c.double)
        q_taken = q_obs.gather(-1, t["action"].unsqueeze(-1)).squeeze(-1)
        loss, td = td_loss(q_taken, targets, to_device(weights, self.device))
        step = self.step(loss, self.sync, self.env_steps)
        if c.prioritized:
            self.replay.update_priorities(idx, td.abs().cpu().numpy())
        self.updates += 1
        self._update_target()
        return {
            "loss": loss.item(),
            "q_mean": q_taken.mean().item(),
            "td_abs": float(td.abs().mean()),
            "grad_norm": float(step["grad_norm"]),
            "lr": step["lr"],
            "beta": self._beta(),
            "replay_size": float(len(self.replay)),
        }

    def _update_target(self) -> None:
        c = self.cfg
        if c.target_tau < 1.0:
            with torch.no_grad():
                for target, online in zip(self.target.parameters(), self.net.parameters(), strict=True):
                    target.lerp_(online, c.target_tau)
        elif self.updates % c.target_update_interval == 0:
            self.target.load_state_dict(self.net.state_dict())

    def state_dict(self) -> dict[str, Any]:
        # the replay buffer is not checkpointed: it refills from actors in seconds and can be huge
        return {
            "net": self.net.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


SPEC = AlgoSpec("dqn", DQNConfig, DQNPolicy, DQNLearner, check_spaces)
