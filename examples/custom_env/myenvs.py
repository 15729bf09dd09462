import gymnasium as gym
import numpy as np


class GridWalk(gym.Env):
    """Walk from cell 0 to the last cell: +1 on arrival, -0.01 per step (at most 50 steps)."""

    def __init__(self, size: int = 8):
        self.size, self.position = size, 0
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)  # 0: left, 1: right

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.position = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.position = max(0, self.position + (1 if action == 1 else -1))
        arrived = self.position == self.size - 1
        return np.array([self.position / (self.size - 1)], np.float32), 1.0 if arrived else -0.01, arrived, False, {}


gym.register("GridWalk-v0", entry_point=GridWalk, max_episode_steps=50)
