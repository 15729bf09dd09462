"""Environments, vectorized per actor: Gymnasium ids (the user's own too) and plain factories.

Three ways to name an environment in `env`:

    id: CartPole-v1                        # registered with Gymnasium
    id: ALE/Pong-v5                        # any Atari game, through ale-py's native vector env
    id: "myenvs:GridWalk-v0"               # import `myenvs` first (its gymnasium.register calls run)
    entry_point: "myenvs:GridWalk"         # a class or function returning a gymnasium.Env, with env.kwargs
    id: smax:3m                            # cooperative multi-agent: SMAX maps, PettingZoo parallel envs
    id: pettingzoo:mpe2.simple_spread_v3   #   (tianji.envs.multiagent)

Every process that builds envs resolves the config itself (importing the module), so roles
started fresh rather than forked, or on other machines, find the user's environment too.
Mistakes raise `ConfigError` naming the field and what was expected.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from tianji.envs.config import EnvConfig
from tianji.envs.multiagent import is_multiagent, make_multiagent, multiagent_spaces
from tianji.sections import ConfigError


def _import_module(module: str, field: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:  # the user's module may fail in any way while importing
        raise ConfigError(
            f"{field}: cannot import module {module!r} ({type(exc).__name__}: {exc}); is it installed or on PYTHONPATH?"
        ) from None


def _ids_registered_by(module: str) -> list[str]:
    def origin(spec: Any) -> str:
        entry = spec.entry_point
        return entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "") or ""

    return sorted(
        env_id
        for env_id, spec in gym.registry.items()
        if origin(spec) == module or origin(spec).startswith(module + ".")
    )


def registered_spec(env_id: str) -> Any:
    """The Gymnasium spec of `env_id`, importing the module first in the `module:EnvId` form."""
    module, _, name = env_id.rpartition(":")
    if module:
        _import_module(module, "env.id")
    try:
        return gym.spec(name)
    except gym.error.Error as exc:
        if module:
            theirs = _ids_registered_by(module)
            found = (
                f"it registered {', '.join(theirs)}"
                if theirs
                else "it registered none (call gymnasium.register at import)"
            )
            raise ConfigError(
                f"env.id: module {module!r} was imported but registered no environment {name!r}; {found}"
            ) from None
        known = ", ".join(sorted(k for k in gym.registry if "/" not in k)[:8])
        raise ConfigError(
            f"env.id: unknown Gymnasium environment {env_id!r} ({exc}); e.g. {known}, ...; "
            "for your own environment use 'module:EnvId' or env.entry_point"
        ) from None


def env_factory(entry_point: str) -> Callable[..., Any]:
    """The callable named by `package.module:attribute` (dots in the attribute reach nested names)."""
    module, _, attribute = entry_point.partition(":")
    target: Any = _import_module(module, "env.entry_point")
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"env.entry_point: module {module!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(
            f"env.entry_point: {entry_point!r} is a {type(target).__name__}, expected a class or "
            "function returning a gymnasium.Env"
        )
    return target


def _make_from_factory(factory: Callable[..., Any], kwargs: dict[str, Any], entry_point: str) -> gym.Env:
    try:
        env = factory(**kwargs)
    except Exception as exc:
        raise ConfigError(f"env.entry_point: {entry_point}(**env.kwargs) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, gym.Env):
        raise ConfigError(f"env.entry_point: {entry_point!r} returned a {type(env).__name__}, expected a gymnasium.Env")
    return env


ATARI_PREFIX = "ALE/"


def is_atari(cfg: EnvConfig) -> bool:
    return cfg.id is not None and cfg.id.startswith(ATARI_PREFIX)


def atari_game(env_id: str) -> str:
    """'ALE/SpaceInvaders-v5' -> 'space_invaders' (ale-py's ROM id)."""
    name = env_id[len(ATARI_PREFIX) :].split("-")[0]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def make_atari(
    cfg: EnvConfig, num_envs: int, threads: int, screen: dict[str, Any] | None = None
) -> gym.vector.VectorEnv:
    """ale-py's native vector env (its C++ thread pool) with the Nature/DQN preprocessing: 84x84 grey,
    frame skip 4 with max-pool, 4 stacked frames, up to 30 no-ops and fire on reset, no sticky actions
    (the published Pong protocol), episodes of at most 108,000 frames; raw game score as reward
    (env.reward_clip clips it for training only). env.kwargs override any of AtariVectorEnv's options;
    `screen` overrides those in turn (the image options of `make_atari_screen`)."""
    try:
        from ale_py import roms
        from ale_py.vector_env import AtariVectorEnv
    except ImportError:
        raise ConfigError(f"env.id {cfg.id!r} needs ale-py: pip install 'tianji[atari]'") from None
    assert cfg.id is not None  # is_atari(cfg)
    game = atari_game(cfg.id)
    if game not in roms.get_all_rom_ids():
        raise ConfigError(f"env.id: ale-py has no game {game!r} (from {cfg.id!r}); e.g. ALE/Pong-v5, ALE/Breakout-v5")
    options = {
        "repeat_action_probability": 0.0,
        "noop_max": 30,
        "use_fire_reset": True,
        "frameskip": 4,
        "stack_num": 4,
        "img_height": 84,
        "img_width": 84,
        "grayscale": True,
        "maxpool": True,
        "reward_clipping": False,
        "episodic_life": False,
        "max_num_frames_per_episode": 108_000,
        "num_threads": threads,
        **cfg.kwargs,
        **(screen or {}),
    }
    try:
        return AtariVectorEnv(game, num_envs, **options)
    except TypeError as exc:
        raise ConfigError(f"env.kwargs: {exc}") from None


class FrameView(gym.vector.VectorObservationWrapper):
    """Frames of a vector env's image observations ([n, stack, H, W]) cropped to `crop` (top, bottom,
    left, right) and max-pooled in `pool` x `pool` blocks (rows or columns that do not fill a block are
    dropped). Only observations change: rewards, ends and the next-step autoreset pass through."""

    def __init__(self, env: gym.vector.VectorEnv, crop: tuple[int, int, int, int] | None, pool: int):
        super().__init__(env)
        stack, height, width = env.single_observation_space.shape or (0, 0, 0)
        self.rows: slice = slice(crop[0], crop[1]) if crop else slice(None)
        self.cols: slice = slice(crop[2], crop[3]) if crop else slice(None)
        height, width = len(range(height)[self.rows]), len(range(width)[self.cols])
        self.pool = pool
        self.shape = (stack, height // pool, width // pool)
        self.single_observation_space = gym.spaces.Box(0, 255, self.shape, np.uint8)
        self.observation_space = gym.spaces.Box(0, 255, (env.num_envs, *self.shape), np.uint8)

    def observations(self, obs: np.ndarray) -> np.ndarray:  # type: ignore[override]  # frames in, frames out
        frames = obs[:, :, self.rows, self.cols]
        if self.pool == 1:
            return np.ascontiguousarray(frames)
        p, (_, height, width) = self.pool, self.shape
        frames = frames[:, :, : height * p, : width * p]
        rows = functools.reduce(np.maximum, (frames[:, :, i::p] for i in range(p)))  # 30x faster than reshape + max
        return functools.reduce(np.maximum, (rows[..., j::p] for j in range(p)))


def frame_view(envs: gym.vector.VectorEnv, cfg: EnvConfig) -> gym.vector.VectorEnv:
    """`envs` with env.crop and env.pool applied (unchanged without them); ConfigError when they do not fit."""
    if cfg.crop is None and cfg.pool == 1:
        return envs
    shape = envs.single_observation_space.shape or ()
    if len(shape) != 3:
        raise ConfigError(
            f"env.crop / env.pool need grey stacked frames [stack, height, width], got observations "
            f"shaped {shape} (set env.kwargs.grayscale true)"
        )
    if cfg.crop is not None and (cfg.crop[1] > shape[1] or cfg.crop[3] > shape[2]):
        raise ConfigError(f"env.crop {list(cfg.crop)}: the frames are {shape[1]}x{shape[2]}")
    view = FrameView(envs, cfg.crop, cfg.pool)
    if 0 in view.shape:
        raise ConfigError(f"env.pool {cfg.pool}: larger than the (cropped) frame")
    return view


class LifeLoss(gym.vector.VectorWrapper):
    """Marks the step on which an Atari game lost a life but goes on (`info["life_lost"]`, from ale-py's
    `info["lives"]`) and names that key in `terminal_info`: the actor records such a step as terminated
    for training (no bootstrap past it) without ending the episode, so nothing is reset and the recorded
    returns stay whole games (env.episodic_life)."""

    terminal_info = "life_lost"

    def __init__(self, env: gym.vector.VectorEnv):
        super().__init__(env)
        self.lives = np.zeros(env.num_envs, np.int64)

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self.lives = np.asarray(info["lives"], np.int64).copy()
        return obs, {**info, self.terminal_info: np.zeros(self.num_envs, bool)}

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(actions)
        lives = np.asarray(info["lives"], np.int64)
        lost = (lives < self.lives) & ~terminated  # a game over is its own terminal already
        self.lives = lives.copy()  # a reset game's lives count from full again
        return obs, reward, terminated, truncated, {**info, self.terminal_info: lost}


ATARI_SCREEN = {"img_height": 210, "img_width": 160, "grayscale": False, "stack_num": 1}


def make_atari_screen(cfg: EnvConfig) -> gym.vector.VectorEnv:
    """One Atari env that shows the game's own screen (210x160, colour) but plays exactly like the first env
    of `make_atari(cfg, ...)`: same options and seed, and the emulator is deterministic, so fed the same
    actions it shows what that env's agent saw in its own (grey, smaller, stacked) frames."""
    return make_atari(cfg, 1, 1, screen=ATARI_SCREEN)


def check_env(cfg: EnvConfig) -> None:
    """Resolve the env config (imports included) without building an env; raises ConfigError."""
    if cfg.entry_point is not None:
        env_factory(cfg.entry_point)
    elif is_multiagent(cfg):
        multiagent_spaces(cfg)
    elif not is_atari(cfg) and cfg.id is not None:
        registered_spec(cfg.id)


class VectorEnvLike(Protocol):
    """What the actor and the evaluator use of a vector env: Gymnasium's, or a multi-agent adapter's."""

    metadata: dict[str, Any]

    @property
    def num_envs(self) -> int: ...
    @property
    def single_observation_space(self) -> gym.Space: ...
    @property
    def single_action_space(self) -> gym.Space: ...
    def reset(self, *, seed: int | None = None) -> tuple[Any, dict[str, Any]]: ...
    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]: ...
    def close(self) -> None: ...


def make_vector_env(cfg: EnvConfig, num_envs: int, threads: int = 1, render: bool = False) -> VectorEnvLike:
    """`num_envs` copies stepped together; a native vectorized implementation when the env has one
    (Atari: ale-py's, with `threads` threads).

    Every vector env here resets a finished sub-env on the *next* step (Gymnasium's
    default), which is the convention the actor's recording relies on.
    """
    render_kwargs: dict[str, Any] = {"render_mode": "rgb_array"} if render else {}  # `render`: frames for a video
    envs: VectorEnvLike
    if is_atari(cfg):
        envs = frame_view(make_atari(cfg, num_envs, threads), cfg)
        if cfg.episodic_life:
            envs = LifeLoss(envs)
    elif is_multiagent(cfg):
        envs = make_multiagent(cfg, num_envs)
    elif cfg.entry_point is not None:
        factory = env_factory(cfg.entry_point)
        kwargs = {**cfg.kwargs, **render_kwargs}
        envs = gym.vector.SyncVectorEnv([partial(_make_from_factory, factory, kwargs, cfg.entry_point)] * num_envs)
    else:
        assert cfg.id is not None  # EnvConfig: an id or an entry point
        spec = registered_spec(cfg.id)
        mode = "vector_entry_point" if spec.vector_entry_point is not None and not cfg.kwargs and not render else "sync"
        try:
            envs = gym.make_vec(spec.id, num_envs=num_envs, vectorization_mode=mode, **cfg.kwargs, **render_kwargs)
        except TypeError as exc:  # an unexpected keyword argument
            raise ConfigError(f"env.kwargs: {spec.id} does not take {cfg.kwargs} ({exc})") from None
    autoreset = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    if autoreset != gym.vector.AutoresetMode.NEXT_STEP:
        raise ConfigError(f"{cfg.describe()}: vector env autoreset mode {autoreset}, expected NEXT_STEP")
    return envs


def env_spaces(cfg: EnvConfig) -> tuple[gym.Space, gym.Space]:
    """Single-env observation and action spaces."""
    if is_multiagent(cfg):
        return multiagent_spaces(cfg)  # without importing JAX into this process
    envs = make_vector_env(cfg, 1)
    try:
        return envs.single_observation_space, envs.single_action_space
    finally:
        envs.close()
