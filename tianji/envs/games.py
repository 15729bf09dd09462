"""Small pixel games for tests and smoke runs: they learn in minutes on a CPU, through the same
uint8 image path as Atari (`env.entry_point: "tianji.envs.games:Catch"`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class Catch(gym.Env):
    """A ball falls from a random column of a `size` x `size` grid; move the paddle on the bottom row
    (left, stay, right) to catch it: +1 caught, -1 missed, then the episode ends. Observations are
    uint8 images, `cell` pixels per grid cell, one channel (channels first)."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 10, cell: int = 4, render_mode: str | None = None):
        self.size, self.cell, self.render_mode = size, cell, render_mode
        side = size * cell
        self.observation_space = gym.spaces.Box(0, 255, (1, side, side), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.ball = np.zeros(2, np.int64)
        self.paddle = size // 2

    def reset(self, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.ball[:] = (0, self.np_random.integers(self.size))
        self.paddle = int(self.np_random.integers(self.size))
        return self._image(), {}

    def step(self, action):
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 0, self.size - 1))
        self.ball[0] += 1
        landed = self.ball[0] == self.size - 1
        reward = (1.0 if self.ball[1] == self.paddle else -1.0) if landed else 0.0
        return self._image(), reward, bool(landed), False, {}

    def _image(self) -> np.ndarray:
        grid = np.zeros((self.size, self.size), np.uint8)
        grid[tuple(self.ball)] = 255
        grid[self.size - 1, self.paddle] = 255
        return np.kron(grid, np.ones((self.cell, self.cell), np.uint8))[None]

    def render(self) -> np.ndarray:  # type: ignore[override, unused-ignore]  # rgb_array: always one frame
        return np.repeat(self._image()[0][..., None], 3, axis=2)
