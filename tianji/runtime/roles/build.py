"""Construct roles from a config; shared by every launcher so they run the same thing."""

from __future__ import annotations

from typing import Any

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


def actor_seed(cfg: Config, actor_id: int) -> int:
    # distinct env seeds for every env of every actor: reset(seed=s) seeds env j with s + j
    return cfg.seed * 1_000_003 + actor_id * cfg.topology.envs_count


def build_actor(cfg: Config, actor_id: int) -> Actor:
    torch.manual_seed(actor_seed(cfg, actor_id) + 1)
    envs = make_vector_env(cfg.env, cfg.topology.envs_count, cfg.topology.actor_threads)
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


def build_learner(cfg: Config, state: dict[str, Any] | None = None) -> Learner:
    """A learner, restored from a checkpoint's `state` when given."""
    torch.manual_seed(cfg.seed)
    obs_space, act_space = env_spaces(cfg.env)
    limiter = RateLimiter(cfg.balance.replay_ratio, cfg.balance.replay_ratio_tolerance)
    algo = get_algo(cfg.algo.name).make_learner(cfg.algo, obs_space, act_space, device=cfg.learner.device)
    learner = Learner(algo, cfg.balance.bound_at_start, limiter, cfg.balance.backpressure)
    if cfg.balance.deterministic:
        learner.own_random = OwnRandom(cfg.seed + 2)
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
