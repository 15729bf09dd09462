"""Gymnasium environments, vectorized per actor."""

from __future__ import annotations

import gymnasium as gym

from tianji.config import ConfigError, EnvConfig


def check_env_id(env_id: str) -> None:
    """Raise ConfigError naming `env.id` when Gymnasium does not know the id."""
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        known = ", ".join(sorted(k for k in gym.registry if "/" not in k)[:8])
        raise ConfigError(f"env.id: unknown Gymnasium environment {env_id!r} ({exc}); e.g. {known}, ...") from None


def make_vector_env(cfg: EnvConfig, num_envs: int) -> gym.vector.VectorEnv:
    """`num_envs` copies stepped together; a native vectorized implementation when the env has one.

    Every vector env here resets a finished sub-env on the *next* step (Gymnasium's
    default), which is the convention the actor's recording relies on.
    """
    check_env_id(cfg.id)
    spec = gym.spec(cfg.id)
    mode = "vector_entry_point" if spec.vector_entry_point is not None and not cfg.kwargs else "sync"
    envs = gym.make_vec(cfg.id, num_envs=num_envs, vectorization_mode=mode, **cfg.kwargs)
    autoreset = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    if autoreset != gym.vector.AutoresetMode.NEXT_STEP:
        raise ValueError(f"env {cfg.id}: vector env autoreset mode {autoreset}, expected NEXT_STEP")
    return envs


def env_spaces(cfg: EnvConfig) -> tuple[gym.Space, gym.Space]:
    """Single-env observation and action spaces."""
    envs = make_vector_env(cfg, 1)
    try:
        return envs.single_observation_space, envs.single_action_space
    finally:
        envs.close()
