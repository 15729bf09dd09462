"""The two small interfaces an algorithm implements; the runtime sees only these.

An algorithm is an `AlgoSpec` found through `tianji.algos.get_algo`:

    spec = get_algo("ppo")
    policy = spec.make_policy(cfg.algo, obs_space, act_space, Placement(actor_id, actors, envs))  # in each actor
    learner = spec.make_learner(cfg.algo, obs_space, act_space)  # in the learner
    spec.check_spaces(obs_space, act_space)                      # ValueError if the algorithm cannot take them
    policy.load_weights(learner.weights())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import gymnasium as gym
import numpy as np
import torch

from tianji.algos.common.optim import NO_HOOK, GradientHook, GradientStep, Optimizer, TrainedSettings
from tianji.algos.common.tensors import Arrays, module_weights, resolve_device


@dataclass(frozen=True)
class Placement:
    """Where a policy runs, for per-actor behaviour such as an exploration ladder."""

    actor_id: int = 0
    num_actors: int = 1
    envs_per_actor: int = 1


ObsT = TypeVar("ObsT", contravariant=True)  # a batch of observations: an array, or arrays by name (multi-agent)


class ActorPolicy(Protocol[ObsT]):
    """Batched inference inside an actor."""

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replace the parameters with a learner's published weights."""

    def act(self, obs: ObsT) -> tuple[np.ndarray, Arrays]:
        """Actions for a batch of observations, plus per-step extras to record (e.g. log-probs)."""

    def greedy(self, obs: ObsT) -> np.ndarray:
        """Deterministic actions for evaluation."""

    def finish_fragment(self, fragment: Arrays, last_obs: ObsT) -> Arrays:
        """Add what the learner needs beyond the recorded steps (e.g. bootstrap values)."""


class AlgoLearner(Protocol):
    """Owns the buffer and the update; the runtime decides when to feed and train it.

    `sync` is set by the runtime (default NO_HOOK); an update calls `self.sync.gradients(params)`
    after every backward(), before clipping and stepping (`tianji.algos.common.optim.GradientStep` does all of it).
    """

    sync: GradientHook
    env_steps: int  # set by the runtime before each update: env steps the learner group has consumed (schedules)

    def parameters(self) -> list[torch.Tensor]:
        """The trained parameters (what a learner group keeps in step)."""

    def optimizer_moments(self) -> list[torch.Tensor]:
        """The optimizer's per-parameter state tensors, in place."""

    def add(self, fragment: Mapping[str, np.ndarray]) -> None:
        """Take one fragment (arrays shaped [T, k, ...] plus per-fragment extras). The arrays may be
        read-only views of shared memory: never write them; copy what must outlive this call
        unless the learner has `holds_fragments = True` (an optional class attribute: then they stay
        valid until the next update returns)."""

    def wants_data(self) -> bool:
        """False while the buffer is full; the runtime then leaves fragments (and credits) with actors."""

    def ready(self) -> bool:
        """True when enough data is buffered for one update."""

    def update(self) -> dict[str, float]:
        """One update; returns scalar stats (prefixed keys are added by the runtime)."""

    def samples_per_update(self) -> int:
        """Env steps consumed by one update (for samples-trained/s)."""

    def weights(self) -> Arrays:
        """Current policy weights as named arrays, ready to publish."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: tensors, ints, floats (loadable with weights_only=True)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def net_weights(state: Mapping[str, Any]) -> Arrays:
    """The policy's weights in a learner checkpoint's `algo` state that keeps its policy as `net`."""
    return {name: tensor.cpu().numpy() for name, tensor in state["net"].items()}


@dataclass(frozen=True)
class AlgoSpec:
    """Everything the runtime and the tools know of an algorithm; each algorithm module defines one
    (`SPEC`) and `tianji.algos.ALGOS` lists them."""

    name: str
    config: type  # its `algo` config section (a pydantic model whose `name` field is `name`)
    make_policy: Callable[
        [Any, gym.Space[Any], gym.Space[Any], Placement], ActorPolicy[Any]
    ]  # (algo config, spaces, where)
    make_learner: Callable[..., AlgoLearner]  # (algo config, obs space, action space, device="cpu")
    check_spaces: Callable[
        [gym.Space[Any], gym.Space[Any]], None
    ]  # raises ValueError naming what the algorithm cannot take
    policy_weights: Callable[[Mapping[str, Any]], Arrays] = net_weights  # from a checkpoint's `algo` state


class BatchSettings(Protocol):
    @property
    def batch_fragments(self) -> int: ...  # fragments gathered into one training batch


class OnPolicyBatches:
    """The buffer of an on-policy learner: at most one batch of `cfg.batch_fragments` fragments, so
    that when the learner is busy back-pressure reaches the actors instead of stale data queueing.
    It keeps the fragments themselves until the update that trains on them (`holds_fragments`): the
    runtime hands them over as views of the actors' shared memory and frees the slots afterwards."""

    holds_fragments = True
    cfg: BatchSettings
    pending: list[Mapping[str, np.ndarray]]
    _samples_per_fragment: int = 0

    def add(self, fragment: Mapping[str, np.ndarray]) -> None:
        self.pending.append(fragment)
        self._samples_per_fragment = int(fragment["reward"].size)

    def wants_data(self) -> bool:
        return len(self.pending) < self.cfg.batch_fragments

    def ready(self) -> bool:
        return len(self.pending) >= self.cfg.batch_fragments

    def samples_per_update(self) -> int:
        return self._samples_per_fragment * self.cfg.batch_fragments

    def take_batch(self) -> list[Mapping[str, np.ndarray]]:
        batch, self.pending = self.pending[: self.cfg.batch_fragments], self.pending[self.cfg.batch_fragments :]
        return batch


NetT = TypeVar("NetT", bound=torch.nn.Module)


class NetAndOptimizer(Generic[NetT]):
    """Weights, parameters and checkpoint state of a learner that trains one `net` with one gradient `step`
    (its optimizer, clip and schedule)."""

    net: NetT
    step: GradientStep
    sync: GradientHook = NO_HOOK
    env_steps: int = 0

    @property
    def optimizer(self) -> Optimizer:
        return self.step.optimizer

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


class OnPolicySettings(BatchSettings, TrainedSettings, Protocol):
    @property
    def epochs(self) -> int: ...
    @property
    def minibatches(self) -> int: ...


class OnPolicyLearner(OnPolicyBatches, NetAndOptimizer[NetT]):
    """What the learners of PPO, IMPALA, APPO and MAPPO share: one network on the learner's device, one
    gradient step (optimizer, clip, schedule), one batch of fragments at a time.

        class PPOLearner(OnPolicyLearner[PolicyValueNet]):
            def __init__(self, cfg, obs_space, act_space, device="cpu"):
                super().__init__(cfg, make_net(cfg, obs_space, act_space), device)
    """

    cfg: OnPolicySettings

    def __init__(self, cfg: OnPolicySettings, net: NetT, device: str = "cpu"):
        self.cfg = cfg
        self.device = resolve_device(device)
        self.net = net.to(self.device)
        self.step = GradientStep.from_config(self.net.parameters(), cfg)
        self.sync = NO_HOOK
        self.env_steps = 0
        self.pending = []
