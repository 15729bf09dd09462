"""SMAX adapter checks, run by tests/test_multiagent.py in a fresh interpreter: JAX must never be
imported into the pytest process, which forks role processes for other tests.

    python tests/smax_checks.py CHECK [CHECK ...]   # shapes, win, truncation, maps
"""

from __future__ import annotations

import sys

import numpy as np

from tianji.config import EnvConfig, load_config
from tianji.envs.make import env_spaces, make_vector_env
from tianji.envs.multiagent import SmaxVectorEnv
from tianji.runtime.roles.build import build_actor, build_learner


def random_available(avail: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (rng.random(avail.shape) * avail).argmax(-1)


def shapes() -> None:
    cfg = EnvConfig(id="smax:3m")
    obs_space, act_space = env_spaces(cfg)
    envs = make_vector_env(cfg, 4)
    obs, _ = envs.reset(seed=0)
    assert obs["obs"].shape == (4, 3, obs_space["obs"].shape[1]) and obs["obs"].dtype == np.float32
    assert obs["state"].shape == (4, obs_space["state"].shape[0])
    assert obs["avail_actions"].shape == (4, 3, 8) and obs["avail_actions"].dtype == bool
    assert obs["active"].all() and obs["first"].all() and list(act_space.nvec) == [8, 8, 8]
    assert np.abs(obs["state"]).max() <= 1.5, "world state scaled to about [-1, 1]"
    next_obs, reward, terminated, truncated, info = envs.step(
        random_available(obs["avail_actions"], np.random.default_rng(0))
    )
    assert reward.shape == (4,) and terminated.shape == (4,) and info["won"].shape == (4,)
    assert not next_obs["first"].any()
    assert envs.max_steps == 60  # SMAC's limit for 3m


def win() -> None:
    """A won episode: the win flag is on the done step itself, the next step starts a new episode."""
    envs = SmaxVectorEnv("3m", 32)
    rng = np.random.default_rng(1)
    obs, _ = envs.reset(seed=1)
    for _ in range(2000):
        actions = _attack_first_available(obs["avail_actions"], rng)
        obs, reward, terminated, truncated, info = envs.step(actions)
        assert not (info["won"] & ~terminated).any(), "a win is a termination"
        if info["won"].any():
            i = int(np.flatnonzero(info["won"])[0])
            assert reward[i] > 0
            after, reward_after, term_after, _, info_after = envs.step(actions)
            assert after["first"][i, 0] and reward_after[i] == 0 and not term_after[i] and not info_after["won"][i]
            print("won")
            return
    raise AssertionError("no episode was won in 2000 steps of focused fire")


def _attack_first_available(avail: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Attack (actions >= 5) when any attack is available, else move at random: wins some episodes."""
    attack = avail.copy()
    attack[..., :5] = False
    moves = (rng.random(avail.shape) * avail).argmax(-1)
    return np.where(attack.any(-1), attack.argmax(-1), moves)


def truncation() -> None:
    """A time-out at the episode limit is a truncation, not a termination."""
    envs = SmaxVectorEnv("3m", 4, max_steps=5)
    obs, _ = envs.reset(seed=0)
    stop = np.full((4, 3), 4)  # SMAX's stop action; the units start out of range
    for _ in range(5):
        obs, reward, terminated, truncated, info = envs.step(stop)
    assert truncated.all() and not terminated.any() and not info["won"].any()
    obs, *_ = envs.step(stop)
    assert obs["first"].all()


def maps() -> None:
    """The harder maps' presets build their learner and actor and step their map (8 steps, 2 envs)."""
    for name in ("smax-3s5z-qmix", "smax-5m-vs-6m-qmix", "smax-6h-vs-8z-qmix"):
        cfg = load_config(name, ["topology.envs_per_actor=2", "topology.fragment_length=8"])
        build_learner(cfg)
        fragment = build_actor(cfg, 0).collect()
        agents = len(env_spaces(cfg.env)[1].nvec)
        assert fragment.arrays["avail_actions"].shape[:3] == (8, 2, agents), name
        print(name, cfg.env.id, agents, "agents")


if __name__ == "__main__":
    for check in sys.argv[1:]:  # one interpreter for several checks: JAX starts once
        {"shapes": shapes, "win": win, "truncation": truncation, "maps": maps}[check]()
        print(check, "ok")
