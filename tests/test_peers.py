"""benchmarks/peers.py at its smallest: one seed of CartPole PPO for TianJi, RLlib and SB3 with a short cap,
and the table it writes. Needs the `peers` extra (pip install -e '.[peers]'); skipped without it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

REPO = Path(__file__).resolve().parents[1]
MISSING = [
    m
    for m in ("ray.rllib", "stable_baselines3", "rl_zoo3")
    if importlib.util.find_spec(m.split(".")[0]) is None
    or (m == "ray.rllib" and importlib.util.find_spec("tree") is None)
]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(MISSING), reason=f"the peers extra is not installed (no {', '.join(MISSING)}): pip install -e '.[peers]'"
)
def test_peers_benchmark_at_its_smallest_writes_its_table(tmp_path):
    out = tmp_path / "peers"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "peers.py"),
        "--tasks",
        "cartpole-ppo",
        "--seeds",
        "1",
        "--cap-s",
        "25",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| cartpole-ppo")]
    assert [row.split("|")[2].strip() for row in rows] == ["tianji", "rllib", "sb3"], table
    assert all("1 reached" in row or "0/1 reached" in row or "1/1 reached" in row for row in rows), table
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["versions"]["ray"]
    assert "4.37x" in table  # the paper's claim stands next to the measurement

    # a second sitting on the same --work reads the finished runs instead of running them again
    logs = {log: log.stat().st_mtime_ns for log in (tmp_path / "work").glob("*.log")}
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert {log: log.stat().st_mtime_ns for log in (tmp_path / "work").glob("*.log")} == logs
    assert out.with_suffix(".md").read_text().splitlines()[3:] == table.splitlines()[3:]


def fake_pong_run(run_dir: Path, curve: list[tuple[float, int, float]], summary: dict) -> None:
    run_dir.mkdir(parents=True)
    lines = ["time_s,env_steps,env/return_mean100"] + [f"{t},{s},{v}" for t, s, v in curve]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_longer_tianji_run_is_read_as_the_cap_saw_it(tmp_path, monkeypatch):
    """A zoo run (60 minutes, reached 18 after 48) linked into --work is judged at a 30-minute cap from its
    metrics: not reached, the score and env steps at 30 minutes, only the thresholds crossed by then."""
    peers = load_benchmark(monkeypatch, "peers")
    curve = [(600.0, 0.6e6, -15.0), (1200.0, 1.2e6, 0.5), (1790.0, 1.8e6, 11.0), (2400.0, 2.4e6, 15.0)]
    summary = {
        "target_reached": True,
        "time_to_target_s": 2850.0,
        "env_steps_to_target": 3_200_000,
        "wall_time_s": 2851.0,
        "env_steps": 3_201_000,
        "stop_reason": "target_return",
    }
    fake_pong_run(tmp_path / "tianji-pong-ppo-s0", curve, summary)
    assert peers.finished(tmp_path / "tianji-pong-ppo-s0", 1800.0)
    run = peers.judge_at_cap(tmp_path / "tianji-pong-ppo-s0", "pong-ppo", 1800.0)
    assert not run["reached"] and run["seconds"] == 1800.0
    assert run["env_steps"] == 1_800_000 and run["final"] == 11.0
    assert set(run["thresholds"]) == {"-15.0", "0.0"} and run["read_at_cap_from"] == "a 48-minute run"
    row = peers.summarise("pong-ppo", "tianji", [run], 1800.0)
    assert "read at the cap from a 48-minute run" in "\n".join(peers.pong_table("pong-ppo", [row]))

    # interrupted before the cap: run again; interrupted after it (a soak run stopped by hand): read at the cap
    interrupted = {**summary, "target_reached": False, "stop_reason": "interrupted", "wall_time_s": 900.0}
    fake_pong_run(tmp_path / "short", curve[:1], interrupted)
    assert not peers.finished(tmp_path / "short", 1800.0)
    fake_pong_run(tmp_path / "long", curve, {**interrupted, "wall_time_s": 3600.0})
    assert peers.finished(tmp_path / "long", 1800.0)

    # a run that ended at its own cap is read as it is
    fake_pong_run(tmp_path / "own", curve[:3], {**summary, "target_reached": False, "wall_time_s": 1795.0})
    own = peers.judge_at_cap(tmp_path / "own", "pong-ppo", 1800.0)
    assert own["seconds"] == 1795.0 and own["env_steps"] == 3_201_000 and "read_at_cap_from" not in own


@pytest.mark.skipif(importlib.util.find_spec("stable_baselines3") is None, reason="stable-baselines3 not installed")
def test_sb3_schedules_are_held_at_their_end_not_stretched_over_the_cap(monkeypatch):
    """rl-zoo's DQN explores over 16 % of its n_timesteps: stretching that over a huge total_timesteps kept
    epsilon near 1 for the whole cap. After n_timesteps the schedules stay at their final values; a learning
    rate that ends at 0 (rl-zoo's lin_) ends the run instead."""
    from stable_baselines3 import DQN, PPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import peers_run

    dqn = DQN("MlpPolicy", "CartPole-v1", learning_rate=2.3e-3, exploration_final_eps=0.04, device="cpu")
    assert peers_run.hold_schedules_at_their_end(dqn)
    assert dqn.exploration_schedule(1.0) == pytest.approx(0.04) and dqn.lr_schedule(1.0) == pytest.approx(2.3e-3)
    ppo = PPO("MlpPolicy", "CartPole-v1", learning_rate=peers_run._schedule("lin_0.001"), device="cpu")
    assert not peers_run.hold_schedules_at_their_end(ppo)


def test_each_row_is_judged_against_its_fastest_peer_and_the_papers_ratio(monkeypatch):
    peers = load_benchmark(monkeypatch, "peers")

    def row(task, system, median_s, final=None, reached=3):
        return {
            "task": task,
            "system": system,
            "median_s": median_s,
            "max_s": 2 * median_s,
            "slowest_seed": 1,
            "final": final,
            "reached": reached,
            "runs": 3,
        }

    rows = [
        row("cartpole-ppo", "tianji", 4.0),
        row("cartpole-ppo", "rllib", 60.0),
        row("cartpole-ppo", "sb3", 17.0),
        row("acrobot-ppo", "tianji", 3.0),
        row("acrobot-ppo", "sb3", 15.0),
        row("pong-ppo", "tianji", 1800.0, final=11.4, reached=0),
        row("pong-ppo", "rllib", 1800.0, final=-20.5, reached=0),
        row("pong-ppo", "sb3", 1800.0, final=-19.0, reached=0),
    ]
    lines = peers.against_the_best_peer(rows)
    assert lines[0] == (
        "- cartpole-ppo: the fastest peer (sb3) took 4.25x TianJi's median time: below the paper's best ratio, 4.37x "
        "(slowest seeds: 4.25x, TianJi's 8.0 s on seed 1 against 34.0 s)"
    )
    assert "(sb3) took 5.00x" in lines[1] and ": meets" in lines[1]
    assert lines[2] == "- pong-ppo: TianJi's score at the cap 11.4, the best peer's (sb3) -19.0: ahead"


def test_the_table_names_the_slowest_seed_and_its_ratio(monkeypatch):
    """Ten seeds: the median alone hides the seed a user may meet, so each row names its slowest seed and the
    peer's ratio is given on the medians and on the slowest seeds."""
    peers = load_benchmark(monkeypatch, "peers")

    def runs(seconds: list[float]) -> list[dict]:
        return [{"reached": True, "seconds": s, "env_steps": 1000, "final": 480.0} for s in seconds]

    ours = peers.summarise("cartpole-ppo", "tianji", runs([4.0, 5.0, 9.0, 4.5]), 300.0)
    sb3 = peers.summarise("cartpole-ppo", "sb3", runs([20.0, 22.0, 18.0, 27.0]), 300.0)
    assert ours["slowest_seed"] == 2 and sb3["slowest_seed"] == 3
    info = {
        "date": "d",
        "cpu": "c",
        "cores": 2,
        "memory_gib": 24,
        "python": "3",
        "versions": dict.fromkeys(
            ("tianji", "torch", "gymnasium", "ale-py", "ray", "stable-baselines3", "rl-zoo3"), "v"
        ),
    }
    table = peers.table([ours, sb3], info)
    sb3_row = next(line for line in table.splitlines() if line.startswith("| cartpole-ppo") and "| sb3 |" in line)
    assert "27.0 s (seed 3)" in sb3_row and "4.42x, 3.00x" in sb3_row, sb3_row
    assert "9.0 s on seed 2 against 27.0 s" in table


def test_a_sitting_keeps_the_rows_of_the_tasks_it_did_not_run(tmp_path, monkeypatch):
    """CartPole one day, Pong another: the results an earlier sitting wrote keep their other tasks' rows and
    runs, marked with that sitting's date; the tasks run again are replaced."""
    peers = load_benchmark(monkeypatch, "peers")
    old = {
        "machine": {"date": "2026-12-05"},
        "rows": [
            {"task": "cartpole-ppo", "system": "tianji"},
            {"task": "pong-appo", "system": "tianji", "final": 10.3},
        ],
        "runs": {"cartpole-ppo/tianji": [{"seconds": 9.0}], "pong-appo/tianji": [{"seconds": 1800.0}]},
    }
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(old))
    rows, runs = peers.earlier_rows(path, ["cartpole-ppo", "acrobot-ppo"])
    assert rows == [{"task": "pong-appo", "system": "tianji", "final": 10.3, "sitting": "2026-12-05"}]
    assert list(runs) == ["pong-appo/tianji"]
    assert peers.earlier_sittings(rows) == [
        "Rows kept from an earlier sitting (its date): pong-appo (2026-12-05).",
        "",
    ]
    assert peers.earlier_rows(tmp_path / "none.json", ["cartpole-ppo"]) == ([], {})


def test_rllib_rows_stop_at_their_own_seed_count_except_on_pong(monkeypatch):
    peers = load_benchmark(monkeypatch, "peers")
    three = argparse.Namespace(rllib_seeds=3)
    assert [peers.beyond_rllib_seeds(three, "cartpole-ppo", seed) for seed in (2, 3)] == [False, True]
    assert not peers.beyond_rllib_seeds(three, "pong-ppo", 5)
    assert not peers.beyond_rllib_seeds(argparse.Namespace(rllib_seeds=None), "acrobot-ppo", 9)
