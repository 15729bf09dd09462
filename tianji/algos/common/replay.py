"""Prioritized experience replay on a vectorized sum-tree (no per-item Python loops).

replay = PrioritizedReplay(capacity=1 << 20, fields={"obs": ((4,), np.float32), ...}, alpha=0.6)
replay.add({"obs": obs_batch, ...}, priorities)        # batched insert, ring buffer
idx, batch, weights = replay.sample(256, beta=0.4, rng=rng)
replay.update_priorities(idx, np.abs(td_errors))       # batched
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class SumTree:
    """Binary tree over `capacity` leaves (rounded up to a power of two); node = sum of its children.

    Leaves live at [size, 2 * size); the root is node 1. Batched updates and
    batched prefix-sum searches touch one tree level per NumPy operation.
    """

    def __init__(self, capacity: int):
        self.size = 1 << max(0, int(capacity - 1).bit_length())
        self.depth = self.size.bit_length() - 1
        self.nodes = np.zeros(2 * self.size, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        return self.nodes[self.size + np.asarray(idx)]

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves `idx` to `values` (last write wins for duplicates) and refresh their ancestors."""
        node = self.size + np.asarray(idx, dtype=np.int64)
        self.nodes[node] = values
        for _ in range(self.depth):  # duplicates write the same sum twice, which is cheaper than np.unique
            node >>= 1
            self.nodes[node] = self.nodes[2 * node] + self.nodes[2 * node + 1]

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """Leaf index whose cumulative-sum interval holds each prefix value (values in [0, total))."""
        prefix = np.array(prefix, dtype=np.float64)
        node = np.ones(len(prefix), dtype=np.int64)
        for _ in range(self.depth):
            left = self.nodes[2 * node]
            go_right = prefix >= left
            prefix -= np.where(go_right, left, 0.0)
            node = 2 * node + go_right
        return node - self.size


class PrioritizedReplay:
    """Ring buffer of transitions with proportional prioritized sampling."""

    def __init__(
        self, capacity: int, fields: Mapping[str, tuple[tuple[int, ...], np.dtype]], alpha: float, eps: float = 1e-6
    ):
        self.capacity = capacity
        self.alpha = alpha
        self.eps = eps
        self.data = {name: np.zeros((capacity, *shape), dtype=dtype) for name, (shape, dtype) in fields.items()}
        self.tree = SumTree(capacity)
        self.cursor = 0
        self.count = 0
        self.max_priority = 1.0

    def __len__(self) -> int:
        return self.count

    def add(self, batch: Mapping[str, np.ndarray], priorities: np.ndarray | None = None) -> None:
        n = len(next(iter(batch.values())))
        if n == 0:
            return
        if n > self.capacity:  # keep the newest
            batch = {k: v[-self.capacity :] for k, v in batch.items()}
            priorities = None if priorities is None else priorities[-self.capacity :]
            n = self.capacity
        idx = (self.cursor + np.arange(n)) % self.capacity
        for name, values in batch.items():
            self.data[name][idx] = values
        if priorities is None:
            priorities = np.full(n, self.max_priority)
        self._set_priorities(idx, priorities)
        self.cursor = int((self.cursor + n) % self.capacity)
        self.count = min(self.capacity, self.count + n)

    def sample(
        self, batch_size: int, beta: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Stratified proportional sample; returns indices, the batch and normalised importance weights."""
        total = self.tree.total
        bounds = (np.arange(batch_size) + rng.random(batch_size)) * (total / batch_size)
        idx = np.minimum(self.tree.find(np.minimum(bounds, np.nextafter(total, 0))), self.count - 1)
        probs = self.tree.leaves(idx) / total
        weights = (self.count * np.maximum(probs, 1e-12)) ** (-beta)
        weights /= weights.max()
        return idx, {name: values[idx] for name, values in self.data.items()}, weights.astype(np.float32)

    def update_priorities(self, idx: np.ndarray, priorities: np.ndarray) -> None:
        self._set_priorities(idx, priorities)

    def _set_priorities(self, idx: np.ndarray, priorities: np.ndarray) -> None:
        priorities = np.abs(np.asarray(priorities, dtype=np.float64)) + self.eps
        self.max_priority = max(self.max_priority, float(priorities.max()))
        self.tree.update(idx, priorities**self.alpha)


class SequenceReplay:
    """Fixed-length sequences (a fragment's column per env) in a ring buffer, sampled uniformly."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data: dict[str, np.ndarray] = {}
        self.cursor = self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, fragment: Mapping[str, np.ndarray], time_major: set[str]) -> None:
        """Store the k sequences of a fragment: keys in `time_major` are [T, k, ...], the rest [k, ...]."""
        k = fragment["reward"].shape[1]
        columns = {key: (np.swapaxes(v, 0, 1) if key in time_major else v) for key, v in fragment.items()}
        if not self.data:
            self.data = {key: np.zeros((self.capacity, *v.shape[1:]), v.dtype) for key, v in columns.items()}
        idx = (self.cursor + np.arange(k)) % self.capacity
        for key, value in columns.items():
            self.data[key][idx] = value
        self.cursor = int((self.cursor + k) % self.capacity)
        self.count = min(self.capacity, self.count + k)

    def sample(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        idx = rng.integers(0, self.count, batch)
        return {key: values[idx] for key, values in self.data.items()}
