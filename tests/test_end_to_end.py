"""Seconds-long runs of every launcher, resume, and Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tianji.config import build_config
from tianji.runtime.process.life import pid_alive
from tianji.runtime.shared.checkpoint import load_learner
from tianji.runtime.transport.shm import shm_root
from tianji.tools.train import train

from conftest import assert_lag_bounded, child_pids, newest_set, wait_for

SUMMARY_KEYS = {
    "target_reached",
    "time_to_target_s",
    "env_steps_to_target",
    "final_return_mean100",
    "env_steps",
    "wall_time_s",
    "policy_lag_max",
    "policy_lag_mean",
    "fragments_dropped",
}


def check_run_dir(run_dir: Path, min_steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["env_steps"] >= min_steps
    assert (run_dir / "config.yaml").exists() and (run_dir / "meta.json").exists()
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    assert rows and {"env/return_mean100", "perf/env_steps_per_s", "balance/lag_max", "perf/learner_busy"} <= set(
        rows[0]
    )
    assert any((run_dir / "tensorboard").iterdir())
    state = torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)
    assert state["version"] == summary["policy_version"] > 0
    return summary


@pytest.mark.parametrize("launcher", ["inline", "local"])
def test_short_run_writes_the_run_directory(launcher, tiny_config, tmp_path):
    cfg = tiny_config(max_env_steps=4096)
    run_dir, summary = train(cfg, launcher, run_dir=str(tmp_path / launcher))
    summary = check_run_dir(run_dir, 4096)
    assert summary["stop_reason"] == "max_env_steps"
    assert_lag_bounded(summary, cfg.balance.max_policy_lag)
    # this run's files carry this process's pid (its driver); other runs on the machine keep theirs
    assert not list(shm_root().glob(f"tianji-*p{os.getpid()}-*")), "shared memory must be removed"


@pytest.mark.parametrize("launcher", ["inline", "local"])
def test_resume_continues_from_the_last_checkpoint(launcher, tiny_config, tmp_path):
    run_dir, first = train(tiny_config(max_env_steps=2048), launcher, run_dir=str(tmp_path / "run"))
    version = load_learner(run_dir / "checkpoints")["version"]
    # actors keep stepping while the stop propagates, so the first run may pass 2048 by a few fragments
    more = first["env_steps"] + 2048
    resumed_dir, second = train(tiny_config(max_env_steps=more), launcher, resume=str(run_dir))
    assert resumed_dir == run_dir
    assert second["env_steps"] >= more
    assert second["policy_version"] > version
    assert second["episodes"] > first["episodes"]


def test_ctrl_c_checkpoints_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / ("run-with-a-long-name-" + "x" * 80)  # the closing line must not wrap it
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tianji",
            "train",
            "cartpole-ppo",
            "--run-dir",
            str(run_dir),
            "--set",
            "stop.target_return=null",
            "--set",
            "stop.max_wall_time_s=120",
            "--set",
            "logging.interval_s=0.2",
            "--set",
            "logging.console=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not ((run_dir / "metrics.csv").exists() and len(child_pids(process.pid)) >= 2):
            time.sleep(0.2)
        time.sleep(1.0)
        children = child_pids(process.pid)
        assert len(children) >= 2, "learner and actor processes should be running"
        roles = json.loads((run_dir / "roles.json").read_text())
        priorities = {role: os.getpriority(os.PRIO_PROCESS, pid) for role, pid in roles.items()}
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert not [p for p in children if pid_alive(p)], "every child process must end"
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert priorities.pop("learner0") == mine
    assert priorities and set(priorities.values()) == {min(mine + 10, 19)}, "actors yield to the learner"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    assert (newest_set(run_dir) / "learner.pt").exists()
    assert f"run directory: {run_dir}" in output.splitlines()


def successor_slot_file(roles_file, victim: int) -> bool:
    """The replacement of actor0 is running and has written its own slot file."""
    try:
        pid = json.loads(roles_file.read_text())["actor0"]
    except (ValueError, KeyError):  # roles.json being rewritten
        return False
    return pid != victim and any(shm_root().glob(f"tianji-*-actor0-pid{pid}"))


def test_killed_actor_is_restarted_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tianji",
            "train",
            "cartpole-ppo",
            "--run-dir",
            str(run_dir),
            "--set",
            "stop.target_return=null",
            "--set",
            "stop.max_wall_time_s=14",
            "--set",
            "topology.actors=2",
            "--set",
            "logging.interval_s=0.2",
            "--set",
            "logging.console=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        roles_file = run_dir / "roles.json"
        deadline = time.time() + 60
        while time.time() < deadline and not (roles_file.exists() and (run_dir / "metrics.csv").exists()):
            time.sleep(0.2)
        time.sleep(2.0)
        victim = json.loads(roles_file.read_text())["actor0"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        successor_has_own_slots = wait_for(lambda: successor_slot_file(roles_file, victim), seconds=30)
        victim_slots_left = list(shm_root().glob(f"tianji-*-actor0-pid{victim}"))
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] >= 1
    assert json.loads((run_dir / "roles.json").read_text())["actor0"] != victim
    assert successor_has_own_slots, "the restarted actor writes its own slot file"
    assert not victim_slots_left, "the dead actor's slot file is removed when it is replaced"
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    after = [r for r in rows if float(r["time_s"]) > summary["wall_time_s"] - (time.time() - killed_at) + 2]
    assert after and float(after[-1]["env_steps"]) > float(after[0]["env_steps"]), "training must go on"


def test_inline_runs_repeat_exactly_with_the_same_seed(tiny_config, tmp_path):
    first_dir, first = train(tiny_config(max_env_steps=2048), "inline", run_dir=str(tmp_path / "a"))
    second_dir, second = train(tiny_config(max_env_steps=2048), "inline", run_dir=str(tmp_path / "b"))
    assert (first["episodes"], first["final_return_mean100"]) == (second["episodes"], second["final_return_mean100"])
    a = load_learner(first_dir / "checkpoints")["algo"]["net"]
    b = load_learner(second_dir / "checkpoints")["algo"]["net"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("launcher", ["inline", "local"])
def test_short_dqn_run_with_evaluation_and_rate_limiter(launcher, tmp_path):
    from tianji.config import load_config

    cfg = load_config(
        "cartpole-apex",
        [
            f"logging.run_root={tmp_path}",
            "logging.console=false",
            "logging.interval_s=0.2",
            "stop.target_return=null",
            "stop.max_env_steps=4000",
            "eval.interval_s=0.2",
            "eval.episodes=4",
            "algo.learning_starts=500",
            "algo.batch_size=32",
            "balance.replay_ratio=2",
        ],
    )
    run_dir, summary = train(cfg, launcher)
    summary = check_run_dir(run_dir, 4000)
    assert summary["eval_rounds"] >= 1 and summary["final_eval_return_mean"] is not None
    assert summary["target_metric"].startswith("eval/")
    assert 2 * 0.9 * 0.9 <= summary["replay_ratio"] <= 2 * 1.1 * 1.1
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    assert any(r["eval/return_mean"] not in ("", "nan") for r in rows)


def test_resume_a_group_of_two_learners(tiny_config, tmp_path):
    def config(steps):
        raw = tiny_config(max_env_steps=steps).model_dump(mode="json")
        raw["topology"].update(learners=2, actors=2)
        return build_config(raw)

    run_dir, first = train(config(2048), "local", run_dir=str(tmp_path / "run"))
    versions = [load_learner(run_dir / "checkpoints", rank)["version"] for rank in (0, 1)]
    assert versions[0] == versions[1] > 0  # allreduce: the learners step together
    _, second = train(config(first["env_steps"] + 2048), "local", resume=str(run_dir))
    assert second["policy_version"] > versions[0]
    assert all(load_learner(run_dir / "checkpoints", rank)["version"] > versions[rank] for rank in (0, 1))


def test_resume_with_another_number_of_learners_is_refused(tiny_config, tmp_path):
    from tianji.runtime.shared.checkpoint import CheckpointError, FileStore

    run_dir, _ = train(tiny_config(max_env_steps=1024), "inline", run_dir=str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match="resume with as many learners"):
        FileStore(run_dir / "checkpoints", rank=1).load()


def test_a_rank_killed_before_its_first_checkpoint_restarts_from_rank_zeros(tiny_config, tmp_path):
    from tianji.runtime.shared.checkpoint import FileStore

    run_dir, _ = train(tiny_config(max_env_steps=1024), "inline", run_dir=str(tmp_path / "run"))
    restored = FileStore(run_dir / "checkpoints", rank=1).load(restart=True)
    assert restored["version"] == load_learner(run_dir / "checkpoints", 0)["version"]


@pytest.mark.parametrize(
    "algo, balance",
    [
        ({"name": "ppo", "epochs": 1, "minibatches": 1}, {"max_policy_lag": 1}),
        ({"name": "dqn", "learning_starts": 256, "batch_size": 32}, {"max_policy_lag": 32, "replay_ratio": 4}),
    ],
)
def test_inline_and_local_run_the_same_balance_logic(algo, balance, tmp_path):
    """Both launchers drive one learner service: credits granted, lag inside the bound, nothing (PPO) or
    almost nothing (DQN) dropped: lag-aware credits keep actors from producing fragments destined to
    be dropped; the replay ratio held."""
    raw = {
        "name": "balance",
        "algo": algo,
        "stop": {"max_env_steps": 4096},
        "topology": {"actors": 2, "envs_per_actor": 4, "fragment_length": 16},
        "balance": {**balance, "max_inflight": 2},
        "logging": {"console": False, "interval_s": 0.2},
    }
    summaries = {
        launcher: train(build_config(raw), launcher, run_dir=str(tmp_path / launcher))[1]
        for launcher in ("inline", "local")
    }
    bound = balance["max_policy_lag"]
    for launcher, summary in summaries.items():
        # updates per fragment vary with the rate limiter: there the credits predict them roughly
        assert_lag_bounded(summary, bound, 0.05 if "replay_ratio" in balance else 0.0)
        assert summary["fragments_trained"] <= summary["credits_granted"], launcher  # only granted slots are filled
        if "replay_ratio" in balance:
            assert abs(summary["replay_ratio"] / balance["replay_ratio"] - 1) < 0.25, (
                launcher,
                summary["replay_ratio"],
            )


def test_a_learner_group_under_allreduce_ends_with_identical_checkpoints(tmp_path):
    """The group end to end: two learners that average every gradient step together end bit-identical."""
    raw = {
        "name": "group",
        "topology": {"actors": 2, "learners": 2, "envs_per_actor": 4, "fragment_length": 16},
        "algo": {"name": "ppo", "epochs": 1, "minibatches": 1},
        "stop": {"max_env_steps": 4096},
        "sync": {"mode": "allreduce"},
        "logging": {"console": False},
    }
    run_dir, summary = train(build_config(raw), "local", run_dir=str(tmp_path / "run"))
    first, second = (load_learner(run_dir / "checkpoints", rank) for rank in (0, 1))
    assert first["version"] == second["version"] > 0
    for name, tensor in first["algo"]["net"].items():
        assert torch.equal(tensor, second["algo"]["net"][name]), name
    # each learner measured the group's collectives at start, with a bucket of the model's size
    parameters = sum(t.numel() for t in first["algo"]["net"].values())
    for role in ("learner0", "learner1"):
        costs = summary["measured_costs"][role]
        assert costs["allreduce_bucket_bytes"] == 4 * parameters
        # both times only measured, not ordered: gloo's long tail (benchmarks/results/test-bars.md)
        assert costs["allreduce_latency_s"] > 0 and costs["allreduce_bucket_s"] > 0
        assert costs["allreduce_bytes_per_s"] > 0


def test_a_learner_group_under_average_differs_by_no_more_than_each_learners_own_progress(tmp_path):
    """Relaxed sync end to end: learners train on their own and average parameters every 4 updates, so at
    the end they differ, but by no more than what each learned on its own since the last average (the
    sum of its own updates' largest parameter changes): the average before that is common."""
    raw = {
        "name": "group",
        "topology": {"actors": 2, "learners": 2, "envs_per_actor": 4, "fragment_length": 16},
        "algo": {"name": "ppo", "epochs": 1, "minibatches": 1},
        "stop": {"max_env_steps": 8192},
        "sync": {"mode": "average", "every": 4},
        "logging": {"console": False},
    }
    run_dir, _ = train(build_config(raw), "local", run_dir=str(tmp_path / "run"))
    first, second = (load_learner(run_dir / "checkpoints", rank) for rank in (0, 1))
    assert min(first["sync"]["averages"], second["sync"]["averages"]) >= first["updates"] // 4 - 2
    apart = max(
        float((tensor - second["algo"]["net"][name]).abs().max()) for name, tensor in first["algo"]["net"].items()
    )
    own = first["sync"]["own_progress"] + second["sync"]["own_progress"]
    print(f"\n  average every 4: learners apart by {apart:.2e}, own progress since the last average {own:.2e}")
    assert apart <= own + 1e-6, (apart, own)  # without the averages applied: 1.3e-2 apart vs 2.7e-3 own


@pytest.mark.parametrize(
    "balance",
    [
        {"max_policy_lag": 0, "publish_delay": 2},
        {"max_policy_lag": 0, "publish_delay": 2, "publish_delay_varies": True},
        {"max_policy_lag": 2, "refresh_weights": "step"},
    ],
    ids=["publish_delay", "publish_delay_varies", "refresh_weights"],
)
def test_delayed_and_mid_fragment_weights_run_inside_the_lag_bound(balance, tmp_path):
    """publish_delay keeps a bound-0 run synchronous (lag 0) while its actors act with weights two updates
    old (so the learner sees a behaviour KL above 0); actors taking weights between steps keep the bound."""
    raw = {
        "name": "weights",
        "algo": {"name": "ppo", "epochs": 2, "minibatches": 2, "lr": 3e-3, "stale_correction": True},
        "stop": {"max_env_steps": 6144},
        "topology": {"actors": 2, "envs_per_actor": 4, "fragment_length": 32},
        "balance": {**balance, "max_inflight": 2},
        "logging": {"console": False, "interval_s": 0.2},
    }
    run_dir, summary = train(build_config(raw), "local", run_dir=str(tmp_path / "run"))
    assert summary["stop_reason"] == "max_env_steps"
    assert_lag_bounded(summary, balance["max_policy_lag"])
    if "publish_delay" in balance:
        rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
        assert max(float(r["train/behaviour_kl"] or 0) for r in rows) > 1e-4  # 0 (to 1e-7) when fresh


def test_the_ray_launcher_runs_the_same_config_from_the_command_line(tmp_path):
    """The first tier's one Ray run: a Ray instance for this run only, started by the CLI in its own
    interpreter (Ray never enters the test process, which forks roles); the clusters are in test_ray.py."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tianji",
            "train",
            "cartpole-ppo",
            "--launcher",
            "ray",
            "--run-dir",
            str(tmp_path / "run"),
        ]
        + [f"--set={override}" for override in ("stop.target_return=null", "stop.max_env_steps=8000")]
        + ["--set=logging.console=false"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["env_steps"] >= 8000 and summary["updates"] > 0 and summary["fragments_over_network"] == 0
    assert load_learner(tmp_path / "run" / "checkpoints", 0)["version"] > 0  # the checkpoint came back to the driver


def test_an_auto_lag_bound_runs_and_logs_its_bound_under_both_launchers(tmp_path):
    """balance.max_policy_lag: auto end to end (its decisions: test_balance.py and test_components.py):
    actors get room for its credits, the bound and the credits are in every metrics row, the lag within it."""
    raw = {
        "name": "auto",
        "algo": {"name": "appo", "epochs": 1, "minibatches": 1},
        "stop": {"max_env_steps": 4096},
        "topology": {"actors": 2, "envs_per_actor": 4, "fragment_length": 16},
        "balance": {"max_policy_lag": "auto", "lag_start": 2},
        "logging": {"console": False, "interval_s": 0.2},
    }
    for launcher in ("inline", "local"):
        run_dir, summary = train(build_config(raw), launcher, run_dir=str(tmp_path / launcher))
        rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
        bounds = {float(r["balance/lag_bound"]) for r in rows if r["balance/lag_bound"] not in ("", "nan")}
        assert bounds and min(bounds) >= 1 and max(bounds) <= 16, (launcher, bounds)
        assert {float(r["balance/inflight"]) for r in rows if r["balance/inflight"] not in ("", "nan")} <= {1, 2, 3, 4}
        assert summary["policy_lag_max"] <= max(bounds), (launcher, summary)
