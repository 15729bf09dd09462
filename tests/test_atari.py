"""One Atari preset for every game: each benchmark game builds and steps, a lost life is a terminal for
training only (env.episodic_life), the returns' math stops there, and benchmarks/atari.py's table."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from tianji.algos.common.returns import compute_gae, nstep_transitions, vtrace
from tianji.config import ConfigError, load_config
from tianji.envs.make import LifeLoss
from tianji.runtime.roles.actor import Actor
from tianji.runtime.roles.build import build_actor

from conftest import FakePolicy, load_benchmark

BENCHMARK_GAMES = ["BeamRider", "Qbert", "SpaceInvaders", "Seaquest", "Enduro", "Pong"]


@pytest.mark.parametrize("game", BENCHMARK_GAMES)
def test_the_atari_preset_builds_and_steps_every_benchmark_game(game):
    pytest.importorskip("ale_py")
    cfg = load_config(
        "atari-appo", [f"env.id=ALE/{game}-v5", "topology.envs_per_actor=2", "topology.fragment_length=100"]
    )
    actor = build_actor(cfg, 0)
    for _ in range(2):  # 400 env steps with the preset's own network
        arrays = actor.collect().arrays
        assert arrays["obs"].shape == (100, 2, 4, 42, 42) and arrays["obs"].dtype == np.uint8
        assert np.isfinite(arrays["logp"]).all() and (np.abs(arrays["reward"]) <= 1).all()  # clipped for training


class LivesEnv(gym.vector.VectorEnv):
    """One env whose game has 3 lives, one lost every 3 steps (reward 1 a step); the game ends with the last."""

    def __init__(self):
        self.num_envs = 1
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (1, 2), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([2])
        self.t, self.ended = 0, False

    def _obs(self):
        return np.array([[self.t, 0]], np.float32)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(), {"lives": np.array([3])}

    def step(self, actions):
        if self.ended:  # next-step autoreset
            self.t, self.ended = 0, False
            return self._obs(), np.zeros(1), np.zeros(1, bool), np.zeros(1, bool), {"lives": np.array([3])}
        self.t += 1
        lives = 3 - self.t // 3
        self.ended = lives == 0
        return self._obs(), np.ones(1), np.array([self.ended]), np.zeros(1, bool), {"lives": np.array([lives])}


def test_a_lost_life_is_a_terminal_for_training_but_the_game_and_its_return_go_on():
    actor = Actor(actor_id=0, envs=LifeLoss(LivesEnv()), policy=FakePolicy(), fragment_length=11, seed=0)
    a = actor.collect().arrays
    np.testing.assert_array_equal(a["terminated"][:, 0], [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0])  # lives lost at 3, 6
    np.testing.assert_array_equal(a["done"][:, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0])  # the game ends at 9
    np.testing.assert_array_equal(a["valid"][:, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1])
    assert actor.drain_episodes() == [(9.0, 9)]  # the whole game's score, not a life's


def test_gae_stops_at_a_terminal_that_does_not_end_the_episode():
    rewards = np.array([[1.0], [2.0], [4.0]], np.float32)
    values = np.array([[0.5], [0.25], [1.0]], np.float32)
    lost_life = np.array([[0], [1], [0]], bool)
    advantages, _ = compute_gae(rewards, values, np.array([2.0]), np.zeros_like(lost_life), lost_life, 0.9, 0.8)
    assert advantages[1, 0] == pytest.approx(2.0 - 0.25)  # nothing from the next life
    assert advantages[2, 0] == pytest.approx(4.0 + 0.9 * 2.0 - 1.0)
    assert advantages[0, 0] == pytest.approx(1.0 + 0.9 * 0.25 - 0.5 + 0.9 * 0.8 * advantages[1, 0])


def test_vtrace_stops_at_a_terminal_that_does_not_end_the_episode():
    rewards, values = torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([[0.5], [0.25], [1.0]])
    lost_life, zeros = torch.tensor([[0.0], [1.0], [0.0]]), torch.zeros(3, 1)
    vs, advantages = vtrace(zeros, zeros, rewards, values, torch.tensor([2.0]), zeros, lost_life, 0.9, 1.0)
    assert vs[1, 0] == pytest.approx(2.0) and advantages[1, 0] == pytest.approx(2.0 - 0.25)


def test_nstep_returns_stop_at_a_terminal_that_does_not_end_the_episode():
    rewards = np.array([[1.0], [2.0], [4.0]], np.float32)
    lost_life = np.array([[1], [0], [0]], bool)
    returns, discounts, steps = nstep_transitions(
        rewards, lost_life, np.zeros_like(lost_life), np.ones_like(lost_life), 0.9, 3
    )
    assert (returns[0, 0], discounts[0, 0], steps[0, 0]) == (1.0, 0.0, 1)


def test_episodic_life_is_for_atari_only():
    with pytest.raises(ConfigError, match="env.episodic_life apply to Atari"):
        load_config("cartpole-ppo", ["env.episodic_life=true"])


def fake_atari_run(run_dir: Path, game: str, seed: int, curve: list[tuple[float, int, float]]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump({"name": "atari-appo", "seed": seed, "env": {"id": f"ALE/{game}-v5"}})
    )
    (run_dir / "summary.json").write_text(json.dumps({"stop_reason": "max_wall_time_s"}))
    rows = [{"time_s": t, "env_steps": steps, "env/return_mean100": score} for t, steps, score in curve]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_the_atari_table_reads_scores_at_each_mark_against_cleanrl(monkeypatch, tmp_path):
    atari = load_benchmark(monkeypatch, "atari")
    curve = [
        (60.0, 60_000, float("nan")),
        (899.0, 900_000, 300.0),
        (1790.0, 1_800_000, 900.0),
        (3600.0, 3_600_000, 1300.0),
    ]
    row = atari.run_row(fake_atari_run(tmp_path / "a", "BeamRider", 0, curve), 60)
    assert (row["game"], row["seed"]) == ("BeamRider", 0)
    assert row["scores"] == {"15": 300.0, "30": 900.0, "60": 1300.0} and row["env_steps_per_s"] == 1000.0
    other = atari.run_row(fake_atari_run(tmp_path / "b", "BeamRider", 1, [(3600.0, 3_000_000, 1100.0)]), 60)
    table = atari.markdown([row, other])
    assert "| BeamRider | 2 (0, 1) | 300 / 900 / 1,200 (300 / 900 / 1,300; - / - / 1,100) |" in table
    assert "| 2,478 | 48% |" in table and "| missed |" in table  # 1,200 of CleanRL's 2,478
    assert atari.human_normalised("BeamRider", 1200.0) == pytest.approx((1200.0 - 363.9) / (16926.5 - 363.9))
