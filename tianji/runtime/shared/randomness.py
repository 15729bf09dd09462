"""A role's own torch random stream, for runs that must repeat exactly (balance.schedule deterministic).

    stream = OwnRandom(seed)
    with stream.drawing():      # torch's global generator is this role's for the block
        action = policy.act(obs)

Roles that share a process (the inline launcher) would otherwise draw from one global stream in an
order that differs from separate processes; swapping its own stream in around its draws makes each
role draw exactly what it draws in a process of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class OwnRandom:
    def __init__(self, seed: int):
        self.state = torch.Generator().manual_seed(seed).get_state()

    @contextmanager
    def drawing(self) -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)
