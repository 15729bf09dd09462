"""benchmarks/chaos.py on CartPole: a minute of random faults (actors and the learner killed, roles
stopped, the disk full; the evaluator killed again and again; under Ray, a node removed) and the run is
whole again after each, with nothing trained twice or over the lag bound, every checkpoint set good, and
no process or shared-memory file left."""

from __future__ import annotations

import pytest

from tianji.config import load_config

from conftest import load_benchmark

pytestmark = pytest.mark.slow


def test_a_minute_of_random_faults_costs_nothing_that_counts(monkeypatch, tmp_path):
    chaos = load_benchmark(monkeypatch, "chaos")
    settings = chaos.ChaosSettings(
        every_s=(3.0, 6.0),
        faults=("kill-actor", "kill-learner", "stop-role", "full-disk"),
        stop_s=(1.0, 3.0),
        disk_s=2.0,
        seed=0,
        quiet_end_s=8.0,
    )
    overrides = ["stop.target_return=null", "checkpoint.interval_s=1", "logging.interval_s=0.2"]
    result = chaos.run_chaos("cartpole-ppo", tmp_path / "run", settings, 1.0, overrides)
    assert result["returncode"] == 0
    assert result["faults_injected"] >= 5 and {f["kind"] for f in result["faults"]} >= {"kill-actor", "kill-learner"}
    assert_nothing_that_counts_lost(result)
    assert "| fragments trained over the lag bound | 0 |" in chaos.markdown(result)


def test_the_evaluator_killed_again_and_again_comes_back_each_time(monkeypatch, tmp_path):
    chaos = load_benchmark(monkeypatch, "chaos")
    settings = chaos.ChaosSettings(every_s=(1.0, 2.0), faults=("kill-evaluator",), seed=0, quiet_end_s=4.0)
    overrides = ["stop.target_return=null", "eval.interval_s=0.5", "eval.episodes=2", "logging.interval_s=0.2"]
    result = chaos.run_chaos("cartpole-ppo", tmp_path / "run", settings, 0.6, overrides)
    assert result["returncode"] == 0
    assert result["faults_injected"] >= 4 and {f["kind"] for f in result["faults"]} == {"kill-evaluator"}
    assert result["role_restarts"] >= result["faults_injected"]
    assert_nothing_that_counts_lost(result)
    # the faults are deliberate: the caps that stop a crash loop (3 learner restarts) are lifted for them
    assert load_config(str(tmp_path / "run" / "config.yaml")).supervision.max_learner_restarts == 1000


@pytest.mark.ray
def test_nodes_removed_under_ray_and_added_back_cost_nothing_that_counts(monkeypatch, tmp_path):
    pytest.importorskip("ray")
    chaos = load_benchmark(monkeypatch, "chaos")
    settings = chaos.ChaosSettings(every_s=(10.0, 15.0), faults=("remove-node",), seed=0, quiet_end_s=20.0)
    overrides = ["stop.target_return=null", "checkpoint.interval_s=1", "logging.interval_s=0.2"]
    result = chaos.run_chaos("cartpole-ppo", tmp_path / "run", settings, 2.0, overrides, launcher="ray")
    assert result["returncode"] == 0 and result["launcher"] == "ray"
    assert result["faults_injected"] >= 2, result["faults"]
    assert_nothing_that_counts_lost(result)
    assert result["role_restarts"] + result["learner_restarts"] >= result["faults_injected"]
    assert "| remove-node |" in chaos.markdown(result)


def assert_nothing_that_counts_lost(result: dict) -> None:
    assert result["faults_survived"] == result["faults_injected"], result["faults"]
    assert result["fragments_repeated"] == 0 and result["fragments_over_bound"] == 0
    assert result["fragments_lost_beyond_killed_learners"] == 0
    assert result["damaged_sets"] == [] and result["version_backwards"] == []
    assert result["processes_left"] == [] and result["files_left"] == []
