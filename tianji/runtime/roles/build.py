"""Construct roles from a config; shared by every launcher so they run the same thing."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tianji.algos import get_algo
from tianji.algos.base import Placement
from tianji.config import Config
from tianji.envs.make import env_spaces, make_vector_env
from tianji.runtime.balance import RateLimiter
from tianji.runtime.roles.actor import Actor
from tianji.runtime.roles.evaluator import Evaluator
from tianji.runtime.roles.learner import Learner
from tianji.runtime.shared.randomness import OwnRandom

log = logging.getLogger("tianji")


def actor_seed(cfg: Config, actor_id: int) -> int:
    # distinct env seeds for every env of every actor: reset(seed=s) seeds env j with s + j
    return cfg.seed * 1_000_003 + actor_id * cfg.topology.envs_count


def build_actor(cfg: Config, actor_id: int) -> Actor:
    torch.manual_seed(actor_seed(cfg, actor_id) + 1)
    envs = make_vector_env(cfg.env, cfg.topology.envs_count, cfg.topology.actor_threads)
    if cfg.balance.deterministic and actor_id == 0:
        warn_unless_seeded(envs, actor_seed(cfg, actor_id), cfg.env.describe())
    placement = Placement(actor_id, cfg.topology.actor_count, cfg.topology.envs_count)
    policy = get_algo(cfg.algo.name).make_policy(
        cfg.algo, envs.single_observation_space, envs.single_action_space, placement
    )
    actor = Actor(
        actor_id,
        envs,
        policy,
        cfg.topology.fragment_length,
        seed=actor_seed(cfg, actor_id),
        reward_clip=cfg.env.reward_clip,
    )
    if cfg.balance.deterministic:
        actor.own_random = OwnRandom(actor_seed(cfg, actor_id) + 1)
    return actor


def warn_unless_seeded(envs: Any, seed: int, name: str) -> None:
    """balance.schedule deterministic: warn, naming the env, when its reset ignores the seed."""
    first, _ = envs.reset(seed=seed)
    again, _ = envs.reset(seed=seed)
    pairs = [(first[k], again[k]) for k in first] if isinstance(first, dict) else [(first, again)]
    if not all(np.array_equal(a, b) for a, b in pairs):
        log.warning(
            "balance.schedule deterministic: %s starts differently from the same seed (its reset ignores the "
            "seed?): runs will not repeat",
            name,
        )


def build_learner(cfg: Config, state: dict[str, Any] | None = None) -> Learner:
    """A learner, restored from a checkpoint's `state` when given."""
    torch.manual_seed(cfg.seed)
    obs_space, act_space = env_spaces(cfg.env)
    limiter = RateLimiter(cfg.balance.replay_ratio, cfg.balance.replay_ratio_tolerance)
    algo = get_algo(cfg.algo.name).make_learner(cfg.algo, obs_space, act_space, device=cfg.learner.device)
    learner = Learner(algo, cfg.balance.bound_at_start, limiter, cfg.balance.backpressure)
    if cfg.balance.deterministic:
        learner.own_random = OwnRandom(cfg.seed + 2)
        torch.use_deterministic_algorithms(True, warn_only=True)
        if getattr(algo, "device", torch.device("cpu")).type == "cuda":
            log.warning(
                "balance.schedule deterministic: the learner runs on a GPU, whose kernels are not all "
                "deterministic (torch warns about each one it meets); runs may differ in the last bits"
            )
    if state is not None:
        learner.load_state_dict(state)
    return learner


def build_evaluator(cfg: Config) -> Evaluator:
    torch.manual_seed(cfg.seed + 7)
    envs = make_vector_env(cfg.env, cfg.eval.episodes)
    policy = get_algo(cfg.algo.name).make_policy(
        cfg.algo, envs.single_observation_space, envs.single_action_space, Placement()
    )
    return Evaluator(envs, policy, seed=cfg.seed * 1_000_003 + 999_983)
