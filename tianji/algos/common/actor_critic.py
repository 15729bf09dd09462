"""The single-agent policy-value net as PPO, IMPALA and APPO build it from their config, and its two
actor sides: `ActorCriticPolicy` records the actor's values (PPO's GAE can use them), `BehaviourPolicy`
records only the behaviour log-probs (V-trace learners compute values themselves)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, Protocol

import gymnasium as gym
import numpy as np
import torch

from tianji.algos.common.networks import PolicyValueNet
from tianji.algos.common.settings import ConvLayers, ModelName
from tianji.algos.common.tensors import Arrays, load_module_weights


class NetSettings(Protocol):
    """The fields of a config the net is built from."""

    @property
    def name(self) -> str: ...
    @property
    def hidden(self) -> list[int]: ...
    @property
    def model(self) -> ModelName: ...
    @property
    def init(self) -> Literal["default", "orthogonal"]: ...
    @property
    def conv(self) -> ConvLayers | None: ...
    @property
    def conv_features(self) -> int | None: ...


def check_spaces(obs_space: gym.Space, act_space: gym.Space, algo: str = "PPO") -> None:
    """Raise ValueError, naming `algo`, unless the policy-value net can take these spaces."""
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"{algo} needs a Box observation space, got {obs_space}")
    if not isinstance(act_space, (gym.spaces.Discrete, gym.spaces.Box)):
        raise ValueError(f"{algo} supports Discrete or Box action spaces, got {act_space}")


def spaces_check(algo: str) -> Callable[[gym.Space, gym.Space], None]:
    """`check_spaces` for one algorithm's AlgoSpec."""
    return lambda obs_space, act_space: check_spaces(obs_space, act_space, algo)


def make_net(cfg: NetSettings, obs_space: gym.Space, act_space: gym.Space) -> PolicyValueNet:
    check_spaces(obs_space, act_space, cfg.name.upper())
    return PolicyValueNet(obs_space, act_space, cfg.hidden, cfg.model, cfg.init, cfg.conv, cfg.conv_features)


class ActorCriticPolicy:
    """Sampled actions with their log-probs and values; after a fragment, the value to bootstrap from,
    and with `learner_evaluates` the observation after it (the learner then values it itself)."""

    def __init__(self, net: PolicyValueNet, act_space: gym.Space, learner_evaluates: bool = False):
        self.net = net
        self.net.requires_grad_(False)
        self.learner_evaluates = learner_evaluates
        self.low = getattr(act_space, "low", None)
        self.high = getattr(act_space, "high", None)

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_module_weights(self.net, weights)

    def _env_action(self, action: np.ndarray) -> np.ndarray:
        return action if self.net.discrete else np.clip(action, self.low, self.high)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, Arrays]:
        action, logp, value = self.net.sample(torch.from_numpy(obs))
        action_np = action.numpy()
        return self._env_action(action_np), {"action": action_np, "logp": logp.numpy(), "value": value.numpy()}

    @torch.no_grad()
    def greedy(self, obs: np.ndarray) -> np.ndarray:
        return self._env_action(self.net.greedy(torch.from_numpy(obs)).numpy())

    @torch.no_grad()
    def finish_fragment(self, fragment: Arrays, last_obs: np.ndarray) -> Arrays:
        extras = {"bootstrap_value": self.net.value(torch.from_numpy(last_obs)).numpy()}
        return {**extras, "last_obs": last_obs} if self.learner_evaluates else extras


class BehaviourPolicy(ActorCriticPolicy):
    """Only the behaviour log-probs and the observation after the fragment: the learner computes
    values with its own parameters (V-trace)."""

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, Arrays]:
        action, logp, _ = self.net.sample(torch.from_numpy(obs))
        action_np = action.numpy()
        return self._env_action(action_np), {"action": action_np, "logp": logp.numpy()}

    def finish_fragment(self, fragment: Arrays, last_obs: np.ndarray) -> Arrays:
        return {"last_obs": last_obs}
