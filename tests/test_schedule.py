"""balance.schedule deterministic: a run is a function of its seed and layout, the same under every
launcher; and the schedule's own rules (tianji.runtime.balance.FixedSchedule)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from tianji.cli import main
from tianji.config import ConfigError, load_config
from tianji.runtime.balance import FixedSchedule
from tianji.runtime.driver.ordered import ScheduledEpisodes
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.runtime.roles.service import LearnerService
from tianji.runtime.shared.protocol import Hello
from tianji.tools.replay import run_differences
from tianji.tools.train import train

SPREAD = "pettingzoo:mpe2.simple_spread_v3"
LAUNCHERS = ("inline", "local")


def deterministic_run(tmp_path: Path, name: str, preset: str, steps: int, launcher: str, *overrides: str):
    settings = [
        "balance.schedule=deterministic",
        f"stop.max_env_steps={steps}",
        "stop.target_return=null",
        "stop.max_wall_time_s=300",
        "logging.console=false",
        "eval.interval_s=null",
        *overrides,
    ]
    run_dir, summary = train(load_config(preset, settings), launcher, run_dir=str(tmp_path / name))
    return run_dir, summary


def assert_same_run(first: tuple[Path, dict], second: tuple[Path, dict]) -> None:
    """The same final weights byte for byte, every update's statistics, the summary but for times, and
    the deterministic schedule kept to the end by both (a fallback to the free one fails this)."""
    assert run_differences(first[0], second[0]) == []


# ---------------------------------------------------------------- the schedule's rules


def test_fragments_are_trained_in_turn_each_from_the_weights_ahead_fragments_back():
    schedule = FixedSchedule(actor_ids=[3, 1], ahead=1, budget=6)  # positions: actor 1 first, then 3
    schedule.start(0, "w0")
    assert schedule.next_grant(1) == (0, 0, "w0") and schedule.next_grant(3) == (1, 0, "w0")
    assert schedule.next_grant(1) is None, "fragment 2 starts from fragment 0's weights: not trained yet"
    schedule.arrived(3, 0, "fragment 1")  # out of turn: waits
    assert schedule.next_to_take() is None
    schedule.arrived(1, 0, "fragment 0")
    assert schedule.next_to_take() == "fragment 0"
    assert schedule.next_to_take() is None, "fragment 1 waits until fragment 0's updates are done"
    schedule.trained(1, "w1")
    assert schedule.next_grant(1) == (2, 1, "w1")
    assert schedule.next_to_take() == "fragment 1"
    schedule.trained(1, "w1 again")  # fragment 1 completed no batch: the same version
    assert schedule.next_grant(3) == (3, 1, "w1 again")
    assert not schedule.finished
    assert 0 not in schedule.starts and 1 not in schedule.starts, "each start is handed out once"


def test_a_budget_ends_the_grants_and_finishes_once_its_fragments_are_trained():
    schedule = FixedSchedule(actor_ids=[0], ahead=0, budget=2)
    schedule.start(0, "w")
    for seq in range(2):
        assert schedule.next_grant(0) is not None
        schedule.arrived(0, seq, seq)
        assert schedule.next_to_take() == seq
        schedule.trained(seq + 1, "w")
    assert schedule.next_grant(0) is None and schedule.finished


def test_a_restarted_actor_ends_the_schedule_and_its_credits_carry_no_weights_after():
    cfg = load_config("cartpole-ppo", ["balance.schedule=deterministic"])
    service = LearnerService(build_learner(cfg), cfg)
    service.hello("actor0-first", Hello(actor=0, slots=2))
    assert service.schedule is not None and service.grants()[0].weights is not None, "credits carry the weights"
    service.hello("actor0-restarted", Hello(actor=0, slots=2))
    assert service.schedule is None and service.reporter.event()["schedule"] == "free"
    assert all(grant.weights is None for grant in service.grants())


def test_episodes_are_settled_in_the_schedules_order_whatever_order_the_actors_report_in():
    order = ScheduledEpisodes(actors=2, window=2)  # fragments of 100 env steps: 0 of actor 0, 0 of 1, 1 of 0, ...
    assert list(order.report(1, 1, 100, [(10.0, 5)], [0])) == [], "actor 1's k=0 waits for actor 0's k=0"
    settled = list(order.report(0, 2, 200, [(2.0, 5), (4.0, 5)], [0, 1]))
    assert settled == [(None, 100), (6.0, 200), (7.0, 300)], "in order: actor 0's k=0, actor 1's k=0, actor 0's k=1"
    assert list(order.report(0, 1, 100, [(8.0, 5)], [2])) == [], "actor 0's k=2 waits for actor 1's k=1"
    assert list(order.report(1, 1, 100, [], [])) == [(6.0, 500)]
    assert order.all_episodes_mean() == 6.0


def test_a_target_is_reached_at_the_same_env_step_in_every_run(tmp_path):
    """The training mean judged in the schedule's order: inline and local runs reach the target at the
    same env step with the same mean, a whole number of fragments into the schedule."""
    runs = [deterministic_run(tmp_path, run, "cartpole-ppo", 200000, run, "stop.target_return=60") for run in LAUNCHERS]
    summaries = [summary for _, summary in runs]
    assert all(s["target_reached"] and s["schedule"] == "deterministic" for s in summaries), summaries
    assert len({(s["env_steps_to_target"], s["return_at_target"]) for s in summaries}) == 1, summaries
    cfg = load_config("cartpole-ppo")
    assert summaries[0]["env_steps_to_target"] % (cfg.topology.envs_per_actor * cfg.topology.fragment_length) == 0


def test_a_deterministic_schedule_needs_a_fixed_lag_and_no_diagnostic_delay():
    with pytest.raises(ConfigError, match="fixes the lag"):
        load_config("cartpole-appo", ["balance.schedule=deterministic", "balance.max_policy_lag=auto"])
    with pytest.raises(ConfigError, match="publish_delay must be 0"):
        load_config("cartpole-appo", ["balance.schedule=deterministic", "balance.publish_delay=2"])


# ---------------------------------------------------------------- whole runs


@pytest.mark.parametrize("preset, steps", [("cartpole-ppo", 16384), ("cartpole-appo", 30000)])
def test_inline_and_local_launchers_give_the_same_run(tmp_path, preset, steps):
    inline = deterministic_run(tmp_path, "inline", preset, steps, "inline")
    local = deterministic_run(tmp_path, "local", preset, steps, "local")
    assert_same_run(inline, local)


def test_dqn_gives_the_same_run_with_its_replay_sampled_from_its_seed(tmp_path):
    inline = deterministic_run(tmp_path, "inline", "cartpole-dqn", 4096, "inline")
    local = deterministic_run(tmp_path, "local", "cartpole-dqn", 4096, "local")
    assert_same_run(inline, local)


@pytest.mark.parametrize("preset", ["mpe-spread-mappo", "smax-3m-qmix"])
def test_multiagent_runs_repeat_under_both_launchers(tmp_path, preset):
    """MAPPO and QMIX on PettingZoo's MPE spread (small fragments): the same run inline and local."""
    small = (f"env.id={SPREAD}", "topology.envs_per_actor=4", "topology.fragment_length=10", "stop.target_metric=train")
    inline = deterministic_run(tmp_path, "inline", preset, 3000, "inline", *small)
    local = deterministic_run(tmp_path, "local", preset, 3000, "local", *small)
    assert_same_run(inline, local)


@pytest.mark.slow
def test_a_learner_group_under_allreduce_repeats_exactly(tmp_path):
    group = ("topology.learners=2", "topology.actors=2")
    first = deterministic_run(tmp_path, "first", "cartpole-ppo", 16384, "local", *group)
    second = deterministic_run(tmp_path, "second", "cartpole-ppo", 16384, "local", *group)
    assert_same_run(first, second)


def test_runs_resumed_from_the_same_checkpoint_are_identical_from_there(tmp_path):
    """A resumed run starts a fresh schedule from the checkpoint (its envs reset from the seed): two
    resumes of one checkpoint give the same run; the run that was never stopped is another one."""
    start_dir, _ = deterministic_run(tmp_path, "start", "cartpole-appo", 8192, "local")
    for name in ("a", "b"):
        shutil.copytree(start_dir, tmp_path / name)
    resumed = []
    for name in ("a", "b"):
        cfg = load_config(str(tmp_path / name / "config.yaml"), ["stop.max_env_steps=16384"])
        resumed.append(train(cfg, "local", resume=str(tmp_path / name)))
    assert_same_run(*resumed)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["schedule"] == "deterministic"


class UnseededEnv(gym.Env):
    """An env whose reset ignores its seed (draws from numpy's global stream)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, True, False, {}


def test_an_env_that_ignores_its_seed_is_named_in_a_warning(caplog):
    overrides = ["balance.schedule=deterministic", "env.id=null", "env.entry_point=test_schedule:UnseededEnv"]
    cfg = load_config("cartpole-ppo", overrides)
    with caplog.at_level("WARNING", logger="tianji"):
        build_actor(cfg, 0).envs.close()
    assert "starts differently from the same seed" in caplog.text and "UnseededEnv" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tianji"):
        build_actor(load_config("cartpole-ppo", ["balance.schedule=deterministic"]), 0).envs.close()
    assert "starts differently" not in caplog.text


def test_runs_that_differ_are_told_apart_and_a_free_run_is_not_taken_for_a_deterministic_one(tmp_path):
    first = deterministic_run(tmp_path, "seed0", "cartpole-ppo", 4096, "inline")
    other_seed = deterministic_run(tmp_path, "seed1", "cartpole-ppo", 4096, "inline", "seed=1")
    differences = run_differences(first[0], other_seed[0])
    assert any(line.startswith("final weights") for line in differences)
    assert any(line.startswith("versions.jsonl") for line in differences)
    free_dir, _ = train(
        load_config("cartpole-ppo", ["stop.max_env_steps=4096", "stop.target_return=null", "logging.console=false"]),
        "inline",
        run_dir=str(tmp_path / "free"),
    )
    assert any("schedule 'free', not deterministic" in line for line in run_differences(first[0], free_dir))


def test_tianji_compare_says_whether_two_runs_are_the_same_run(tmp_path, capsys):
    first = deterministic_run(tmp_path, "first", "cartpole-ppo", 2048, "inline")
    again = deterministic_run(tmp_path, "again", "cartpole-ppo", 2048, "inline")
    other_seed = deterministic_run(tmp_path, "other", "cartpole-ppo", 2048, "inline", "seed=1")
    assert main(["compare", str(first[0]), str(again[0])]) == 0
    assert "the same run" in capsys.readouterr().out
    assert main(["compare", str(first[0]), str(other_seed[0])]) == 1
    out = capsys.readouterr().out
    assert "final weights" in out and out.rstrip().endswith("differ")
