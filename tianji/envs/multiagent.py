"""Cooperative multi-agent environments as vector envs with an agents axis.

A multi-agent vector env steps `num_envs` games of `num_agents` agents each and speaks Gymnasium's
vector API with dict observations:

    obs = {"obs": [k, n, d] float32,       # each agent's own observation
           "state": [k, s] float32,        # the global state (centralised critics, mixers)
           "avail_actions": [k, n, A] bool, # actions an agent may take now
           "active": [k, n] bool,          # the agent is still in the game (False: masked out)
           "first": [k, 1] bool}           # the first observation of an episode (recurrent policies reset)
    obs, team_reward[k], terminated[k], truncated[k], info = envs.step(actions[k, n])
    info["won"]: [k] bool, the episode ended in a win (SMAC's measure)

Finished games are reset on the following step (Gymnasium's next-step autoreset), as every vector
env in TianJi. Adapters:
- `smax:MAP` (e.g. smax:3m): SMAX, JaxMARL's JAX version of the StarCraft Multi-Agent Challenge maps,
  against its scripted enemies, all envs in one jit(vmap(...)) call; episodes end at SMAC's limits
  (a time-out is a truncation);
- `pettingzoo:PACKAGE.MODULE` (e.g. pettingzoo:mpe2.simple_spread_v3): any PettingZoo parallel env.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from typing import Any

import gymnasium as gym
import numpy as np

from tianji.envs.config import EnvConfig
from tianji.sections import ConfigError

SMAX_PREFIX = "smax:"
PETTINGZOO_PREFIX = "pettingzoo:"
# SMAC's episode limits (steps); a map not listed keeps SMAX's default
SMAC_EPISODE_LIMITS = {
    "3m": 60,
    "8m": 120,
    "25m": 150,
    "2s3z": 120,
    "3s5z": 150,
    "5m_vs_6m": 70,
    "8m_vs_9m": 120,
    "10m_vs_11m": 150,
    "27m_vs_30m": 180,
    "3s5z_vs_3s6z": 170,
    "3s_vs_5z": 250,
    "6h_vs_8z": 150,
    "MMM": 150,
    "MMM2": 180,
    "2s_vs_1sc": 300,
    "3s_vs_3z": 150,
    "3s_vs_4z": 200,
    "2m_vs_1z": 150,
    "so_many_banelings": 100,
    "corridor": 400,
    "bane_vs_bane": 200,
    "1c3s5z": 180,
}


def is_multiagent(cfg: EnvConfig) -> bool:
    return cfg.id is not None and cfg.id.startswith((SMAX_PREFIX, PETTINGZOO_PREFIX))


def make_multiagent(cfg: EnvConfig, num_envs: int) -> MultiAgentVectorEnv:
    assert cfg.id is not None  # is_multiagent(cfg)
    if cfg.id.startswith(SMAX_PREFIX):
        return SmaxVectorEnv(cfg.id[len(SMAX_PREFIX) :], num_envs, **cfg.kwargs)
    return PettingZooVectorEnv(cfg.id[len(PETTINGZOO_PREFIX) :], num_envs, cfg.kwargs)


_SIZES: dict[str, tuple[int, int, int, int]] = {}  # env config -> (agents, obs, state, actions), per process


def multiagent_spaces(cfg: EnvConfig) -> tuple[gym.spaces.Dict, gym.spaces.MultiDiscrete]:
    """Single-env spaces without stepping an env. For SMAX in a process that has not imported JAX
    (the driver, which forks the roles), they are read in a child process: a forked role must never
    inherit a running JAX runtime. Cached, so roles forked later know them too."""
    assert cfg.id is not None  # is_multiagent(cfg)
    key = json.dumps([cfg.id, cfg.kwargs], sort_keys=True, default=str)
    if key not in _SIZES:
        if cfg.id.startswith(SMAX_PREFIX):
            name = cfg.id[len(SMAX_PREFIX) :]
            _SIZES[key] = (
                smax_sizes(name, cfg.kwargs) if "jax" in sys.modules else _smax_sizes_in_child(name, cfg.kwargs)
            )
        else:
            envs = make_multiagent(cfg, 1)
            _SIZES[key] = envs.sizes
            envs.close()
    n, obs_dim, state_dim, actions = _SIZES[key]
    return observation_space(n, obs_dim, state_dim, actions), gym.spaces.MultiDiscrete([actions] * n)


_CHILD = """
import json, sys
from tianji.sections import ConfigError
from tianji.envs.multiagent import smax_sizes
try:
    print(json.dumps({"sizes": smax_sizes(*json.loads(sys.argv[1]))}))
except ConfigError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _smax_sizes_in_child(map_name: str, kwargs: dict[str, Any]) -> tuple[int, int, int, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([map_name, kwargs])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = out.stdout.strip().splitlines()
    reply: dict[str, Any] = (
        json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr.strip()[-2000:]}
    )
    if "error" in reply:
        raise ConfigError(reply["error"])
    agents, obs, state, actions = reply["sizes"]
    return int(agents), int(obs), int(state), int(actions)


def observation_space(n: int, obs_dim: int, state_dim: int, actions: int) -> gym.spaces.Dict:
    return gym.spaces.Dict(
        {
            "obs": gym.spaces.Box(-np.inf, np.inf, (n, obs_dim), np.float32),
            "state": gym.spaces.Box(-np.inf, np.inf, (state_dim,), np.float32),
            "avail_actions": gym.spaces.MultiBinary((n, actions)),
            "active": gym.spaces.MultiBinary(n),
            "first": gym.spaces.MultiBinary(1),
        }
    )


class MultiAgentVectorEnv:
    """Shared bookkeeping: spaces, next-step autoreset flags, the recorded info keys."""

    metadata: dict[str, Any] = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}
    recorded_info: tuple[str, ...] = ("won",)  # per-step info the actor records beside the rows
    render_mode = None
    num_envs: int
    single_observation_space: gym.spaces.Dict
    single_action_space: gym.spaces.MultiDiscrete

    def reset(self, *, seed: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        raise NotImplementedError

    def step(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict]:
        raise NotImplementedError

    def _spaces(self, n: int, obs_dim: int, state_dim: int, actions: int) -> None:
        self.num_agents = n
        self.sizes = (n, obs_dim, state_dim, actions)
        self.single_observation_space = observation_space(n, obs_dim, state_dim, actions)
        self.single_action_space = gym.spaces.MultiDiscrete([actions] * n)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- SMAX (JAX)


def _quiet_single_core_jax() -> None:
    """JAX on the CPU only, on one core (both cores were no faster), set before jax is imported."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # compiled steps are kept on disk: a second actor, the evaluator and the next run skip the compile
    cache = os.environ.get("TIANJI_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tianji"))
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cache, "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


@contextlib.contextmanager
def _quiet_stdout():
    """Silence file descriptor 1 (what is printed there bypasses sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def make_smax(map_name: str, kwargs: dict[str, Any]) -> Any:
    """JaxMARL's HeuristicEnemySMAX on `map_name` with SMAC's episode limit; imports JAX (one core)."""
    _quiet_single_core_jax()
    try:
        with _quiet_stdout():  # jaxmarl prints about optional submodules at import
            from jaxmarl.environments.smax import HeuristicEnemySMAX, map_name_to_scenario
    except ImportError:
        raise ConfigError("env.id 'smax:...' needs JaxMARL: pip install 'tianji[smax]'") from None
    try:
        scenario = map_name_to_scenario(map_name)
    except KeyError:
        raise ConfigError(f"env.id: SMAX has no map {map_name!r}; e.g. 3m, 8m, 2s3z, 3s5z, 5m_vs_6m") from None
    options = {
        "see_enemy_actions": True,
        "walls_cause_death": True,
        "attack_mode": "closest",
        "max_steps": SMAC_EPISODE_LIMITS.get(map_name, 100),
        **kwargs,
    }
    # SMAX itself ends an episode one step after max_steps; the adapter counts steps and truncates
    # at the limit itself, so SMAX's own time-out never fires first
    limit = options["max_steps"]
    try:
        env = HeuristicEnemySMAX(scenario=scenario, **{**options, "max_steps": limit + 2})
    except TypeError as exc:
        raise ConfigError(f"env.kwargs: SMAX does not take {kwargs} ({exc})") from None
    env.episode_limit = limit  # type: ignore[attr-defined]  # read by SmaxVectorEnv
    return env


def smax_sizes(map_name: str, kwargs: dict[str, Any], env: Any = None) -> tuple[int, int, int, int]:
    """(agents, observation, state, actions) sizes of a SMAX map, traced, not compiled."""
    env = make_smax(map_name, kwargs) if env is None else env
    import jax

    obs, _ = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    first = env.agents[0]
    return (
        env.num_allies,
        int(env.observation_spaces[first].shape[0]),
        int(obs["world_state"].shape[-1]),
        int(env.action_spaces[first].n),
    )


def world_state_scale(env: Any) -> np.ndarray:
    """Factors that bring SMAX's world state to about [-1, 1]: it holds unit positions in map units
    (0-32) and weapon cooldowns in steps (up to ~20), which made the mixer's hypernetworks diverge."""
    units, features = env.num_allies + env.num_enemies, len(env.own_features)
    scale = np.ones(units * features + 2 * units, np.float32)
    for u in range(units):
        scale[u * features + 1] = 1.0 / env.map_width
        scale[u * features + 2] = 1.0 / env.map_height
        scale[u * features + 3] = 1.0 / 20.0
    return scale


class SmaxVectorEnv(MultiAgentVectorEnv):
    """SMAX maps against the scripted enemies (HeuristicEnemySMAX); one jitted, vmapped step for all
    envs, NumPy arrays out. Compiling a step takes seconds, once per process and batch size."""

    def __init__(self, map_name: str, num_envs: int, **kwargs: Any):
        self.env = env = make_smax(map_name, kwargs)
        import jax
        import jax.numpy as jnp

        self.jax, self.num_envs, self.map_name = jax, num_envs, map_name
        self.max_steps = env.episode_limit  # SMAC's: a time-out is a truncation
        self._t = np.zeros(num_envs, np.int64)  # steps into each env's episode
        agents, allies = env.agents, env.num_allies

        state_scale = jnp.asarray(world_state_scale(env))

        def observe(obs, state):
            avail = env.get_avail_actions(state)
            alive = state.state.unit_alive[:allies]
            return (
                jnp.stack([obs[a] for a in agents]),
                obs["world_state"] * state_scale,
                jnp.stack([avail[a] for a in agents]).astype(bool),
                alive,
            )

        def reset_one(key):
            obs, state = env.reset(key)
            return (state, *observe(obs, state))

        def step_one(key, state, actions, needs_reset):
            step_key, reset_key = jax.random.split(key)
            obs_s, state_s, rewards, dones, _ = env.step_env(
                step_key, state, {a: actions[i] for i, a in enumerate(agents)}
            )
            alive = state_s.state.unit_alive
            won = jnp.all(~alive[allies:]) & jnp.any(alive[:allies])
            terminated = jnp.all(~alive[:allies]) | jnp.all(~alive[allies:])
            stepped = (state_s, *observe(obs_s, state_s), rewards[agents[0]], dones["__all__"], terminated, won)
            obs_r, state_r = env.reset(reset_key)
            no = jnp.array(False)
            fresh = (state_r, *observe(obs_r, state_r), jnp.zeros_like(stepped[5]), no, no, no)
            return jax.tree.map(lambda r, s: jax.lax.select(needs_reset, r, s), fresh, stepped)

        self._reset = jax.jit(jax.vmap(reset_one))
        self._step = jax.jit(jax.vmap(step_one))
        self._key = jax.random.PRNGKey(0)
        self._state = None
        self._needs_reset = np.zeros(num_envs, bool)
        self._spaces(*smax_sizes(map_name, kwargs, env))

    def _keys(self):
        self._key, key = self.jax.random.split(self._key)
        return self.jax.random.split(key, self.num_envs)

    def reset(self, seed: int | None = None, options: Any = None):
        if seed is not None:
            self._key = self.jax.random.PRNGKey(seed)
        self._state, obs, world, avail, alive = self._reset(self._keys())
        self._needs_reset[:] = False
        self._t[:] = 0
        return self._dict(obs, world, avail, alive, np.ones(self.num_envs, bool)), {}

    def step(self, actions: np.ndarray):
        first = self._needs_reset.copy()
        out = self._step(self._keys(), self._state, np.asarray(actions, np.int32), first)
        self._state, obs, world, avail, alive, reward, _, terminated, won = out
        terminated = np.array(terminated)
        self._t = np.where(first, 0, self._t + 1)
        truncated = (self._t >= self.max_steps) & ~terminated
        self._needs_reset = terminated | truncated
        return (
            self._dict(obs, world, avail, alive, first),
            np.array(reward, np.float32),
            terminated,
            truncated,
            {"won": np.array(won)},
        )

    def _dict(self, obs, world, avail, alive, first) -> dict[str, np.ndarray]:
        # copies: JAX hands out read-only buffers, torch wants writable ones
        return {
            "obs": np.array(obs, np.float32),
            "state": np.array(world, np.float32),
            "avail_actions": np.array(avail, bool),
            "active": np.array(alive, bool),
            "first": np.asarray(first, bool).reshape(self.num_envs, 1),
        }


# ---------------------------------------------------------------- PettingZoo


class PettingZooVectorEnv(MultiAgentVectorEnv):
    """`num_envs` PettingZoo parallel envs side by side. Agents are the env's `possible_agents`; one
    that leaves early is masked (`active` False, zero observation); the team reward is the sum of
    the agents' rewards; the state is `env.state()` when the env has one, else all observations."""

    recorded_info = ()  # no wins in general

    def __init__(self, module: str, num_envs: int, kwargs: dict[str, Any]):
        try:
            maker = importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(
                f"env.id: cannot import PettingZoo module {module!r} ({type(exc).__name__}: {exc}); "
                "pip install 'tianji[pettingzoo]' or the package that provides it"
            ) from None
        if not hasattr(maker, "parallel_env"):
            raise ConfigError(f"env.id: {module!r} has no parallel_env(); expected a PettingZoo environment module")
        try:
            self.envs = [maker.parallel_env(**kwargs) for _ in range(num_envs)]
        except TypeError as exc:
            raise ConfigError(f"env.kwargs: {module}.parallel_env does not take {kwargs} ({exc})") from None
        self.num_envs = num_envs
        env = self.envs[0]
        self.agents = list(env.possible_agents)
        spaces = [env.action_space(a) for a in self.agents]
        if not all(isinstance(s, gym.spaces.Discrete) for s in spaces):
            raise ConfigError(
                f"env.id: {module} has non-discrete actions {spaces[0]}; QMIX and MAPPO here take Discrete actions"
            )
        self.obs_dim = max(int(np.prod(env.observation_space(a).shape)) for a in self.agents)
        self.actions = max(int(s.n) for s in spaces)
        self._has_state = True
        self._first = np.ones(num_envs, bool)
        self._needs_reset = np.zeros(num_envs, bool)
        self._last: list[dict[str, Any]] = [{} for _ in range(num_envs)]
        obs, _ = self.reset(seed=0)
        self._spaces(len(self.agents), self.obs_dim, obs["state"].shape[-1], self.actions)

    def _state_of(self, env: Any, observations: dict[str, Any]) -> np.ndarray:
        if self._has_state:
            try:
                return np.asarray(env.state(), np.float32).reshape(-1)
            except (NotImplementedError, AttributeError):
                self._has_state = False
        return np.concatenate([self._pad(observations.get(a)) for a in self.agents])

    def _pad(self, obs: Any) -> np.ndarray:
        row = np.zeros(self.obs_dim, np.float32)
        if obs is not None:
            flat = np.asarray(obs, np.float32).reshape(-1)
            row[: flat.size] = flat
        return row

    def _observe(self, i: int, observations: dict[str, Any]) -> None:
        env = self.envs[i]
        self._last[i] = {
            "obs": np.stack([self._pad(observations.get(a)) for a in self.agents]),
            "state": self._state_of(env, observations),
            "avail_actions": np.array(
                [
                    [j < env.action_space(a).n for j in range(self.actions)]
                    if a in env.agents
                    else [j == 0 for j in range(self.actions)]
                    for a in self.agents
                ]
            ),
            "active": np.array([a in env.agents for a in self.agents]),
        }

    def reset(self, seed: int | None = None, options: Any = None):
        for i, env in enumerate(self.envs):
            observations, _ = env.reset(seed=None if seed is None else seed + i)
            self._observe(i, observations)
        self._needs_reset[:] = False
        return self._stack(np.ones(self.num_envs, bool)), {}

    def step(self, actions: np.ndarray):
        reward = np.zeros(self.num_envs, np.float32)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        first = self._needs_reset.copy()
        for i, env in enumerate(self.envs):
            if first[i]:
                observations, _ = env.reset()
                self._observe(i, observations)
                continue
            step = {a: int(actions[i][j]) for j, a in enumerate(self.agents) if a in env.agents}
            observations, rewards, terms, truncs, _ = env.step(step)
            reward[i] = sum(float(r) for r in rewards.values())
            self._observe(i, observations)
            if not env.agents:  # every agent has left: the episode is over
                terminated[i] = any(terms.values()) and not any(truncs.values())
                truncated[i] = not terminated[i]
        self._needs_reset = terminated | truncated
        return self._stack(first), reward, terminated, truncated, {"won": np.zeros(self.num_envs, bool)}

    def _stack(self, first: np.ndarray) -> dict[str, np.ndarray]:
        out = {key: np.stack([last[key] for last in self._last]) for key in ("obs", "state", "avail_actions", "active")}
        out["first"] = first.reshape(self.num_envs, 1)
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()
