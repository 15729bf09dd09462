"""benchmarks/chaos.py on CartPole: a minute of random faults (actors and the learner killed, roles
stopped, the disk full) and the run is whole again after each, with nothing trained twice or over the
lag bound, every checkpoint set good, and no process or shared-memory file left."""

from __future__ import annotations

import pytest

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
    run, returncode = chaos.run_chaos("cartpole-ppo", tmp_path / "run", settings, 1.0, overrides)
    result = chaos.report(run, returncode, None)
    assert returncode == 0
    assert result["faults_injected"] >= 5 and {f["kind"] for f in result["faults"]} >= {"kill-actor", "kill-learner"}
    assert result["faults_survived"] == result["faults_injected"], result["faults"]
    assert result["fragments_repeated"] == 0 and result["fragments_over_bound"] == 0
    assert result["fragments_lost_beyond_killed_learners"] == 0
    assert result["damaged_sets"] == [] and result["version_backwards"] == []
    assert result["processes_left"] == [] and result["files_left"] == []
    assert "| fragments trained over the lag bound | 0 |" in chaos.markdown(result)
