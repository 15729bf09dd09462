"""Optimizers with torch._foreach ops (numerically torch.optim's Adam and RMSprop), the learning-rate
schedule, and the one gradient step every learner takes.

Written here because constructing any torch.optim optimizer imports torch._dynamo, which costs
1-2 s of start-up in every learner process (and in every calibration) before the first update.

    optimizer = make_optimizer(net.parameters(), cfg.optimizer, lr=cfg.lr)       # Adam, RMSprop (PyTorch's or TF's)
    step = GradientStep(optimizer, cfg.max_grad_norm, LinearDecay(cfg.lr_horizon))  # or None: constant
    stats = step(loss, sync, env_steps)      # zero grads, backward, group sync, clip, lr, step
    stats["grad_norm"], stats["lr"]

Losses are means over a batch's valid steps, so `eps` and `max_grad_norm` are per-sample scales: a
reference that sums its loss over B samples (the IMPALA paper: RMSprop eps 0.01, clip 40, B = 32 x 20)
corresponds to eps / B and max_grad_norm / B here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn


class _Foreach:
    """Parameters and named per-parameter state tensors (the moments a learner group may average)."""

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable[torch.Tensor], lr: float):
        self.params: list[torch.Tensor] = [p for p in params if p.requires_grad]
        self.lr = lr
        self.steps = 0
        self.state = {name: [torch.zeros_like(p) for p in self.params] for name in self.state_names}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _with_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Parameters that have gradients, their gradients and their state tensors."""
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in present]
        grads = [p.grad for p in params if p.grad is not None]
        return params, grads, {k: [v[i] for i in present] for k, v in self.state.items()}

    def moments(self) -> list[torch.Tensor]:
        """Every state tensor, in place (what a learner group may average)."""
        return [t for name in self.state_names for t in self.state[name]]

    def state_dict(self) -> dict[str, Any]:
        moments = {name: [t.clone() for t in self.state[name]] for name in self.state_names}
        return {"steps": self.steps, "lr": self.lr, **moments}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.state_names:
            if name not in state or len(state[name]) != len(self.params):
                found = len(state[name]) if name in state else "no"
                raise ValueError(
                    f"optimizer state has {found} {name!r} tensors, expected {len(self.params)} "
                    f"(a checkpoint of another optimizer?)"
                )
        self.steps = int(state["steps"])
        self.lr = float(state.get("lr", self.lr))  # where an adaptive schedule had taken it (absent before)
        with torch.no_grad():
            for name in self.state_names:
                for mine, saved in zip(self.state[name], state[name], strict=True):
                    mine.copy_(saved)


class Adam(_Foreach):
    """torch.optim.Adam's default update (no weight decay, no amsgrad)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        super().__init__(params, lr)
        (self.beta1, self.beta2), self.eps = betas, eps

    @torch.no_grad()
    def step(self) -> None:
        params, grads, state = self._with_grads()
        if not params:
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        self.steps += 1
        torch._foreach_lerp_(m, grads, 1 - self.beta1)
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - self.beta2)
        step_size = self.lr / (1 - self.beta1**self.steps)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - self.beta2**self.steps))
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, m, denom, -step_size)


class RMSprop(_Foreach):
    """torch.optim.RMSprop's update (not centered, no weight decay): a running mean of squared
    gradients with decay `alpha`, eps added to its square root, optional momentum."""

    state_names = ("square_avg", "momentum_buffer")

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        alpha: float = 0.99,
        eps: float = 1e-8,
        momentum: float = 0.0,
    ):
        super().__init__(params, lr)
        self.alpha, self.eps, self.momentum = alpha, eps, momentum

    @torch.no_grad()
    def step(self) -> None:
        params, grads, state = self._with_grads()
        if not params:
            return
        square_avg, buffers = state["square_avg"], state["momentum_buffer"]
        self.steps += 1
        torch._foreach_mul_(square_avg, self.alpha)
        torch._foreach_addcmul_(square_avg, grads, grads, 1 - self.alpha)
        denom = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(denom, self.eps)
        if self.momentum > 0:
            torch._foreach_mul_(buffers, self.momentum)
            torch._foreach_addcdiv_(buffers, grads, denom)
            torch._foreach_add_(params, buffers, alpha=-self.lr)
        else:
            torch._foreach_addcdiv_(params, grads, denom, -self.lr)


class TensorFlowRMSprop(_Foreach):
    """RMSprop in TensorFlow 1's form (tf.train.RMSPropOptimizer), which the IMPALA paper and
    scalable_agent used: the squared-gradient average starts at 1 (not 0) and eps is added inside the
    square root; momentum accumulates lr-scaled steps. Early steps are therefore far more damped than
    PyTorch's, whose average starts at 0 (its first step divides by |g| sqrt(1 - alpha): a jump of
    10 lr per parameter with alpha 0.99).

        ms = alpha ms + (1 - alpha) g^2;  mom = momentum mom + lr g / sqrt(ms + eps);  param -= mom
    """

    state_names = ("ms", "mom")

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        alpha: float = 0.99,
        eps: float = 1e-10,
        momentum: float = 0.0,
        initial_average: float = 1.0,
    ):
        super().__init__(params, lr)
        self.alpha, self.eps, self.momentum = alpha, eps, momentum
        for tensor in self.state["ms"]:
            tensor.fill_(initial_average)

    @torch.no_grad()
    def step(self) -> None:
        params, grads, state = self._with_grads()
        if not params:
            return
        ms, mom = state["ms"], state["mom"]
        self.steps += 1
        torch._foreach_mul_(ms, self.alpha)
        torch._foreach_addcmul_(ms, grads, grads, 1 - self.alpha)
        denom = torch._foreach_add(ms, self.eps)
        torch._foreach_sqrt_(denom)
        torch._foreach_mul_(mom, self.momentum)
        torch._foreach_addcdiv_(mom, grads, denom, self.lr)
        torch._foreach_sub_(params, mom)


Optimizer = Adam | RMSprop | TensorFlowRMSprop


class OptimizerSettings(Protocol):  # tianji.config.OptimizerConfig
    @property
    def name(self) -> str: ...
    @property
    def eps(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def alpha(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def initial_average(self) -> float: ...


def make_optimizer(params: Iterable[torch.Tensor], cfg: OptimizerSettings, lr: float) -> Optimizer:
    if cfg.name == "adam":
        return Adam(params, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.name == "rmsprop":
        return RMSprop(params, lr=lr, alpha=cfg.alpha, eps=cfg.eps, momentum=cfg.momentum)
    if cfg.name == "rmsprop_tf":
        return TensorFlowRMSprop(
            params, lr=lr, alpha=cfg.alpha, eps=cfg.eps, momentum=cfg.momentum, initial_average=cfg.initial_average
        )
    raise ValueError(f"algo.optimizer.name: unknown optimizer {cfg.name!r}; expected 'adam', 'rmsprop' or 'rmsprop_tf'")


class LinearDecay:
    """The learning rate's factor: 1 at the start, falling linearly to 0 after `horizon` env steps."""

    def __init__(self, horizon: int):
        self.horizon = horizon

    def __call__(self, env_steps: int) -> float:
        return max(0.0, 1.0 - env_steps / self.horizon)


class KLAdaptive:
    """rl_games' adaptive learning rate: after each gradient step, up by `factor` when the policy's KL
    from the update's start is under half the target, down by it when over twice the target."""

    def __init__(self, target: float, factor: float = 1.5, low: float = 1e-6, high: float = 1e-2):
        self.target, self.factor, self.low, self.high = target, factor, low, high

    def next_lr(self, lr: float, kl: float) -> float:
        if kl > 2 * self.target:
            return max(lr / self.factor, self.low)
        if kl < self.target / 2:
            return min(lr * self.factor, self.high)
        return lr


def lr_schedule(schedule: str, horizon: int | None) -> LinearDecay | None:
    """None for a constant learning rate (and for kl, which `KLAdaptive` steers step by step)."""
    if schedule in ("constant", "kl"):
        return None
    if horizon is None:
        raise ValueError("algo.lr_schedule 'linear' needs algo.lr_horizon or stop.max_env_steps")
    return LinearDecay(horizon)


class TrainedSettings(Protocol):  # tianji.algos.common.settings.TrainedConfig, plus the clip every algorithm sets
    @property
    def optimizer(self) -> OptimizerSettings: ...
    @property
    def lr(self) -> float: ...
    @property
    def max_grad_norm(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def lr_horizon(self) -> int | None: ...
    @property
    def kl_target(self) -> float: ...


Stats = dict[str, "torch.Tensor | float"]  # one gradient step's numbers (tensors: no device sync until logged)


class GradientHook(Protocol):
    """What an update calls between backward() and the optimizer step: with several learners, the
    runtime's synchronisation (tianji.runtime.sync) averages the gradients there."""

    def gradients(self, params: list[torch.Tensor]) -> None: ...


class _NoHook:
    def gradients(self, params: list[torch.Tensor]) -> None:
        pass


NO_HOOK = _NoHook()


class GradientStep:
    """One optimizer step of a loss: zero the gradients, backward, the learner group's gradient sync,
    clip the global norm, set the scheduled learning rate, step. Returns grad_norm (before clipping)
    and the learning rate used. With `adaptive`, `observe` moves the rate after each step instead."""

    def __init__(
        self,
        optimizer: Optimizer,
        max_grad_norm: float,
        schedule: LinearDecay | None = None,
        adaptive: KLAdaptive | None = None,
    ):
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.schedule = schedule
        self.adaptive = adaptive
        self.base_lr = optimizer.lr

    @classmethod
    def from_config(cls, params: Iterable[torch.Tensor], cfg: TrainedSettings) -> GradientStep:
        """The optimizer, clip and schedule an algorithm's config (`TrainedConfig` fields) asks for."""
        optimizer = make_optimizer(params, cfg.optimizer, cfg.lr)
        adaptive = KLAdaptive(cfg.kl_target) if cfg.lr_schedule == "kl" else None
        return cls(optimizer, cfg.max_grad_norm, lr_schedule(cfg.lr_schedule, cfg.lr_horizon), adaptive)

    def lr(self, env_steps: int) -> float:
        if self.adaptive is not None:
            return self.optimizer.lr  # where `observe` left it (saved with the optimizer's state)
        return self.base_lr * (self.schedule(env_steps) if self.schedule is not None else 1.0)

    def observe(self, stats: Stats) -> None:
        """After a step: an adaptive schedule reads the policy's KL from the update's start."""
        if self.adaptive is not None:
            self.optimizer.lr = self.adaptive.next_lr(self.optimizer.lr, float(stats["approx_kl"]))

    def __call__(self, loss: torch.Tensor, sync: GradientHook, env_steps: int = 0) -> Stats:
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
        sync.gradients(self.optimizer.params)
        grad_norm = nn.utils.clip_grad_norm_(self.optimizer.params, self.max_grad_norm, foreach=True)
        self.optimizer.lr = self.lr(env_steps)
        self.optimizer.step()
        return {"grad_norm": grad_norm.detach(), "lr": self.optimizer.lr}
