"""What every cooperative multi-agent algorithm needs to read the env's spaces (QMIX, MAPPO).

Multi-agent envs are vector envs with dict observations: per-agent `obs`, the global `state`,
`avail_actions` masks; actions are one discrete choice per agent (MultiDiscrete).
"""

from __future__ import annotations

import gymnasium as gym

UNAVAILABLE = -1e9  # the value (or logit) of an unavailable action


def check_multiagent_spaces(obs_space: gym.Space, act_space: gym.Space, algo: str) -> None:
    """Raises ValueError naming what `algo` cannot train on."""
    if not (isinstance(obs_space, gym.spaces.Dict) and {"obs", "state", "avail_actions"} <= set(obs_space.spaces)):
        raise ValueError(
            f"{algo} needs a multi-agent env (smax:MAP or pettingzoo:MODULE), got observations {obs_space}"
        )
    if not isinstance(act_space, gym.spaces.MultiDiscrete):
        raise ValueError(f"{algo} needs one discrete action per agent, got {act_space}")


def team_sizes(obs_space: gym.Space, act_space: gym.Space) -> tuple[int, int, int, int]:
    """(agents, observation size, actions per agent, global state size)."""
    assert isinstance(obs_space, gym.spaces.Dict) and isinstance(act_space, gym.spaces.MultiDiscrete)
    n, obs_dim = obs_space["obs"].shape or (0, 0)
    state = obs_space["state"].shape or (0,)
    return n, obs_dim, int(act_space.nvec[0]), state[0]
