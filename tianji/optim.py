"""Adam with torch._foreach ops, numerically the default update of torch.optim.Adam.

Written here because constructing any torch.optim optimizer imports torch._dynamo, which costs
1-2 s of start-up in every learner process (and in every calibration) before the first update.

    optimizer = Adam(net.parameters(), lr=3e-4)
    loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


class Adam:
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, eps
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        grads = [p.grad for p in params]
        m = [self.exp_avg[index[id(p)]] for p in params]
        v = [self.exp_avg_sq[index[id(p)]] for p in params]
        self.steps += 1
        torch._foreach_lerp_(m, grads, 1 - self.beta1)
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - self.beta2)
        step_size = self.lr / (1 - self.beta1 ** self.steps)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - self.beta2 ** self.steps))
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, m, denom, -step_size)

    def moments(self) -> list[torch.Tensor]:
        """First and second moments, in place (what a learner group may average)."""
        return self.exp_avg + self.exp_avg_sq

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "exp_avg": [t.clone() for t in self.exp_avg],
                "exp_avg_sq": [t.clone() for t in self.exp_avg_sq]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["exp_avg"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(state['exp_avg'])} tensors, expected {len(self.params)}")
        self.steps = int(state["steps"])
        with torch.no_grad():
            for mine, saved in zip(self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])):
                mine.copy_(saved)
