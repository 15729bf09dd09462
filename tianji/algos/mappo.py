"""MAPPO (Yu et al., 2022) and IPPO for cooperative multi-agent envs (tianji.envs.multiagent): one policy
shared by all agents (its observation and its id in, unavailable actions masked), PPO's clipped
surrogate, and a value function on the global state (MAPPO) or on each agent's own observation
(IPPO, `centralised_value: false`). `recurrent: true` gives the policy a GRU memory: actors carry it
across fragments and store it at each fragment's start, and the learner trains on whole env
sequences unrolled from there. The team reward's GAE is computed per env (MAPPO) or per agent
(IPPO) with the same `compute_gae` as PPO, and the same lag machinery applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field
from torch import nn

from tianji.algos.base import AlgoSpec, OnPolicyLearner, Placement
from tianji.algos.common.batches import joined, time_major
from tianji.algos.common.correction import behaviour_gap, first_step_gap
from tianji.algos.common.multiagent import UNAVAILABLE, check_multiagent_spaces, team_sizes
from tianji.algos.common.networks import last_linear
from tianji.algos.common.optim import Stats
from tianji.algos.common.returns import compute_gae
from tianji.algos.common.surrogate import SurrogateConfig, correction_terms, ppo_loss
from tianji.algos.common.tensors import Arrays, explained_variance, load_module_weights, mlp, to_device


class MAPPOConfig(SurrogateConfig):
    name: Literal["mappo"] = Field(
        "mappo",
        description="Algorithm: MAPPO, a shared PPO policy for cooperative "
        "multi-agent envs with a centralised value (IPPO with centralised_value false).",
    )
    lr: float = Field(5e-4, gt=0, description="Learning rate (the start of a schedule).")
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
    epochs: int = Field(5, ge=1, description="Passes over each batch.")
    minibatches: int = Field(2, ge=1, description="Minibatches per epoch.")
    max_grad_norm: float = Field(10.0, gt=0, description="Global gradient-norm clip.")
    centralised_value: bool = Field(
        True, description="Value on the global state (MAPPO); false: on each agent's own observation (IPPO)."
    )
    recurrent: bool = Field(
        False,
        description="A GRU memory in the policy (trained on whole env sequences; minibatches then split the envs).",
    )
    rnn_hidden: int = Field(64, ge=1, description="Width of the policy's GRU when recurrent.")


class SharedActorCritic(nn.Module):
    """The shared policy (an MLP, or with `recurrent_hidden` an encoder + GRU + head that remembers
    the episode) and the value (MLP on the global state, or on each agent's observation)."""

    def __init__(
        self,
        n_agents: int,
        obs_dim: int,
        n_actions: int,
        state_dim: int,
        hidden: list[int],
        centralised_value: bool,
        recurrent_hidden: int | None = None,
    ):
        super().__init__()
        self.n_agents, self.centralised, self.recurrent_hidden = n_agents, centralised_value, recurrent_hidden
        if recurrent_hidden:
            self.encoder = nn.Linear(obs_dim + n_agents, recurrent_hidden)
            self.gru = nn.GRUCell(recurrent_hidden, recurrent_hidden)
            self.pi = nn.Sequential(nn.Linear(recurrent_hidden, n_actions))
        else:
            self.pi = mlp([obs_dim + n_agents, *hidden, n_actions])
        self.v = mlp([state_dim if centralised_value else obs_dim + n_agents, *hidden, 1])
        with torch.no_grad():
            head = last_linear(self.pi)
            head.weight.mul_(0.01)
            head.bias.zero_()

    def agent_inputs(self, obs: torch.Tensor) -> torch.Tensor:
        """[B, n, d] -> [B, n, d + n]: every agent sees its own id."""
        ids = torch.eye(self.n_agents, device=obs.device).expand(obs.shape[0], -1, -1)
        return torch.cat([obs.float(), ids], dim=-1)

    def logits(
        self, obs: torch.Tensor, avail: torch.Tensor, h: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked logits [B, n, A] and the new memory ([B, n, H]; None without recurrence)."""
        x = self.agent_inputs(obs)
        if self.recurrent_hidden:
            assert h is not None, "a recurrent policy needs its memory"
            batch, n = x.shape[:2]
            h = self.gru(torch.relu(self.encoder(x)).reshape(batch * n, -1), h.reshape(batch * n, -1)).reshape(
                batch, n, -1
            )
            x = h
        return self.pi(x).masked_fill(~avail.bool(), UNAVAILABLE), h

    def value(self, obs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[B] on the global state (MAPPO), or [B, n] on each agent's observation (IPPO)."""
        if self.centralised:
            return self.v(state.float()).squeeze(-1)
        return self.v(self.agent_inputs(obs)).squeeze(-1)


def make_net(cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space) -> SharedActorCritic:
    check_spaces(obs_space, act_space)
    n, obs_dim, n_actions, state_dim = team_sizes(obs_space, act_space)
    return SharedActorCritic(
        n, obs_dim, n_actions, state_dim, cfg.hidden, cfg.centralised_value, cfg.rnn_hidden if cfg.recurrent else None
    )


class MAPPOPolicy:
    def __init__(self, cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space, placement: Placement):
        self.net = make_net(cfg, obs_space, act_space)
        self.net.requires_grad_(False)
        self.learner_evaluates = cfg.stale_correction
        self.h: torch.Tensor | None = None  # each env's memory (recurrent), carried across fragments
        self.h0: np.ndarray | None = None  # at the start of the fragment being collected

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    def _memory(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor | None:
        """The memory before this step: zero where an episode starts (None without recurrence)."""
        if not self.net.recurrent_hidden:
            return None
        k, n = obs["obs"].shape[:2]
        if self.h is None:
            self.h = torch.zeros(k, n, self.net.recurrent_hidden)
        self.h[torch.from_numpy(obs["first"].reshape(k).astype(bool))] = 0.0
        if self.h0 is None:
            self.h0 = self.h.numpy().copy()
        return self.h

    @torch.no_grad()
    def act(self, obs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Arrays]:
        t = {key: torch.from_numpy(np.asarray(value)) for key, value in obs.items()}
        logits, self.h = self.net.logits(t["obs"], t["avail_actions"], self._memory(obs))
        log_probs = torch.log_softmax(logits, dim=-1)
        action = torch.distributions.Categorical(logits=log_probs).sample()
        logp = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        value = self.net.value(t["obs"], t["state"])
        return action.numpy(), {"action": action.numpy(), "logp": logp.numpy(), "value": value.numpy()}

    @torch.no_grad()
    def greedy(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        logits, self.h = self.net.logits(
            torch.from_numpy(obs["obs"]), torch.from_numpy(obs["avail_actions"]), self._memory(obs)
        )
        return logits.argmax(-1).numpy()

    @torch.no_grad()
    def finish_fragment(self, fragment: Arrays, last_obs: Mapping[str, np.ndarray]) -> Arrays:
        value = self.net.value(torch.from_numpy(last_obs["obs"]), torch.from_numpy(last_obs["state"]))
        extras = {"bootstrap_value": value.numpy()}
        if self.learner_evaluates:  # the learner evaluates what follows the fragment itself
            extras.update(last_obs=np.asarray(last_obs["obs"]), last_state=np.asarray(last_obs["state"]))
        if self.net.recurrent_hidden:  # the next fragment starts where this one ended
            assert self.h is not None and self.h0 is not None  # a fragment was collected
            extras["h0"], self.h0 = self.h0, self.h.numpy().copy()
        return extras


class MAPPOLearner(OnPolicyLearner[SharedActorCritic]):
    cfg: MAPPOConfig

    def __init__(self, cfg: MAPPOConfig, obs_space: gym.Space, act_space: gym.Space, device: str = "cpu"):
        super().__init__(cfg, make_net(cfg, obs_space, act_space), device)

    def _advantages(
        self, rows: Mapping[str, np.ndarray], values: np.ndarray, bootstrap: np.ndarray, log_ratio: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """GAE of the team reward per env (values [T, K]) or per agent (values [T, K, n]);
        advantages, returns and values, each [T, K, n]. `log_ratio` [T, K, n] (trace_cut): log pi_prox / mu
        of each active agent's action; the team's trace is that of the joint action, min(1, prod of ratios)."""
        T, K, n = rows["active"].shape
        if values.ndim == 2:
            traces = None if log_ratio is None else np.minimum(1.0, np.exp(log_ratio.sum(-1)))
            adv, ret = compute_gae(
                rows["reward"],
                values,
                bootstrap,
                rows["done"],
                rows["terminated"],
                self.cfg.gamma,
                self.cfg.gae_lambda,
                traces,
            )
            return tuple(np.repeat(x[..., None], n, -1) for x in (adv, ret, values))  # type: ignore[return-value]
        per_agent = [
            np.repeat(rows[key][..., None], n, -1).reshape(T, K * n) for key in ("reward", "done", "terminated")
        ]
        adv, ret = compute_gae(
            per_agent[0],
            values.reshape(T, K * n),
            bootstrap.reshape(K * n),
            per_agent[1],
            per_agent[2],
            self.cfg.gamma,
            self.cfg.gae_lambda,
            None if log_ratio is None else np.minimum(1.0, np.exp(log_ratio)).reshape(T, K * n),
        )
        return adv.reshape(T, K, n), ret.reshape(T, K, n), values

    def _batch(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The batch's fragments side by side on the env axis: time-major [T, K, ...] tensors (and each
        env's memory at the start, recurrent), with the log-probs and values the clips are centred on
        (`prox_logp`, `value`: the learner's own with `stale_correction`, else the actors'), advantages and returns."""
        c = self.cfg
        fragments = self.take_batch()
        per_env = ("last_obs", "last_state") if c.stale_correction else ("bootstrap_value",)
        b = time_major(fragments, STEP_KEYS, self.device, per_env + (("h0",) if c.recurrent else ()))
        rows = {
            key: np.asarray(joined(fragments, key, 1)) for key in ("reward", "done", "terminated", "valid", "active")
        }
        if c.stale_correction:
            b["prox_logp"], b["value"], bootstrap = self._evaluate_now(b)
        else:
            b["prox_logp"], bootstrap = b["logp"], b["bootstrap_value"]
        log_ratio = None
        if c.stale_correction and c.trace_cut:  # inactive agents' actions count for nothing
            log_ratio = ((b["prox_logp"] - b["logp"]).cpu().numpy() * rows["active"]).astype(np.float32)
        adv, ret, values = self._advantages(rows, b["value"].cpu().numpy(), bootstrap.cpu().numpy(), log_ratio)
        mask = rows["valid"][..., None] & rows["active"].astype(bool)  # agent-steps that count
        b.update(
            {
                key: to_device(value, self.device)
                for key, value in (("adv", adv), ("ret", ret), ("value", values), ("mask", mask))
            }
        )
        b["first"] = b["first"].bool()
        diagnostics = {"explained_variance": explained_variance(b["value"][b["mask"]], b["ret"][b["mask"]])}
        if c.stale_correction:
            diagnostics.update(behaviour_gap(b["logp"][b["mask"]], b["prox_logp"][b["mask"]], c.rho_bar))
        return b, diagnostics

    @torch.no_grad()
    def _evaluate_now(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs of the actions taken [T, K, n] and values [T, K] or [T, K, n] under the current
        parameters (the proximal policy), and the values of what follows the fragments."""
        T, K = b["action"].shape[:2]
        if self.cfg.recurrent:
            logits = self._unroll(b, torch.arange(K, device=self.device))
        else:
            logits, _ = self.net.logits(
                b["obs"].reshape(T * K, *b["obs"].shape[2:]),
                b["avail_actions"].reshape(T * K, *b["avail_actions"].shape[2:]),
            )
        logp = torch.log_softmax(logits, -1).gather(-1, b["action"].reshape(T * K, -1, 1).long()).squeeze(-1)
        values = self.net.value(
            b["obs"].reshape(T * K, *b["obs"].shape[2:]), b["state"].reshape(T * K, *b["state"].shape[2:])
        )
        return (
            logp.reshape(T, K, -1),
            values.reshape(T, K, *values.shape[1:]),
            self.net.value(b["last_obs"], b["last_state"]),
        )

    def update(self) -> dict[str, float]:
        """`epochs` passes over the batch in `minibatches` parts: of agent-steps, or, recurrent, of
        whole env sequences unrolled from their stored memory."""
        c = self.cfg
        b, diagnostics = self._batch()
        self._first_step_gap: dict[str, float] = {}
        T, K = b["adv"].shape[:2]
        units = K if c.recurrent else T * K
        size = max(1, units // c.minibatches)
        flat = {key: value.reshape(T * K, *value.shape[2:]) for key, value in b.items() if key not in PER_ENV}
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(c.epochs):
            order = torch.randperm(units, device=self.device)
            for start in range(0, units - size + 1, size):
                idx = order[start : start + size]
                if c.recurrent:
                    logits = self._unroll(b, idx)
                    picked = {
                        key: value[:, idx].reshape(T * len(idx), *value.shape[2:])
                        for key, value in b.items()
                        if key not in PER_ENV
                    }
                else:
                    picked = {key: value[idx] for key, value in flat.items()}
                    logits, _ = self.net.logits(picked["obs"], picked["avail_actions"])
                stats = self._step(logits, picked)
                for key, value_ in stats.items():
                    totals[key] = totals.get(key, 0.0) + float(value_)
                steps += 1
        return {**{key: value / max(steps, 1) for key, value in totals.items()}, **diagnostics, **self._first_step_gap}

    def _unroll(self, b: dict[str, torch.Tensor], envs: torch.Tensor) -> torch.Tensor:
        """Logits [T * B, n, A] of the envs' sequences, from their stored memory, reset where an episode starts."""
        h = b["h0"][envs].float()
        logits = []
        for t in range(b["obs"].shape[0]):
            h = h * (~b["first"][t, envs]).float().view(-1, 1, 1)
            step_logits, memory = self.net.logits(b["obs"][t, envs], b["avail_actions"][t, envs], h)
            assert memory is not None
            h = memory
            logits.append(step_logits)
        return torch.cat(logits)

    def _step(self, logits: torch.Tensor, b: dict[str, torch.Tensor]) -> Stats:
        """One optimizer step of PPO's loss over the agent-steps that count."""
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, b["action"].long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs.clamp(min=UNAVAILABLE / 2)).sum(-1)
        value = self.net.value(b["obs"], b["state"])
        if value.dim() == 1:  # a centralised value, one per env: the same for every agent
            value = value.unsqueeze(-1).expand_as(logp)
        mask = b["mask"].bool()
        if not self.cfg.stale_correction and not self._first_step_gap:
            self._first_step_gap = first_step_gap(b["logp"][mask], logp[mask], self.cfg.rho_bar)
        weights, bounds = correction_terms(b["prox_logp"][mask], b["logp"][mask], self.cfg)
        loss, stats = ppo_loss(
            logp[mask],
            b["prox_logp"][mask],
            b["adv"][mask],
            value[mask],
            b["ret"][mask],
            entropy[mask],
            self.cfg,
            b["value"][mask],
            weights,
            bounds,
        )
        stats.update(self.step(loss, self.sync, self.env_steps))
        self.step.observe(stats)
        return stats


STEP_KEYS = ("obs", "state", "avail_actions", "action", "logp", "value", "first")
PER_ENV = ("h0", "last_obs", "last_state", "bootstrap_value")  # [K, ...]: not split into agent-steps


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    check_multiagent_spaces(obs_space, act_space, "MAPPO")


SPEC = AlgoSpec("mappo", MAPPOConfig, MAPPOPolicy, MAPPOLearner, check_spaces)
