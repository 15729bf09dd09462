"""Failures a user meets: a driver killed with kill -9, a learner crash, floods of malformed events,
notices that point outside the run's shared memory."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from tianji.runtime.process.life import limit_file_size, pid_alive, process_tree, run_leftovers, sweep_leftovers
from tianji.runtime.shared.checkpoint import load_learner
from tianji.runtime.transport.shm import SlotReader, SlotWriter, shm_root
from tianji.runtime.transport.wire import WireError, pack_header

from conftest import assert_lag_bounded, newest_set, wait_for


def start_training(run_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "tianji",
        "train",
        "cartpole-ppo",
        "--run-dir",
        str(run_dir),
        "--set",
        "logging.console=false",
        "--set",
        "logging.interval_s=0.2",
    ]
    for item in overrides:
        command += ["--set", item]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_mid_run(run_dir: Path, role: str, *overrides: str, timeout_s: float = 180) -> tuple[dict, int, int, str]:
    """Train, kill `role` with SIGKILL once a checkpoint exists, let the run finish; returns the
    role pids before the kill, the checkpoint's version then, the command's exit code and output."""
    process = start_training(run_dir, "checkpoint.interval_s=0.5", *overrides)
    try:
        assert wait_for(lambda: (run_dir / "roles.json").exists() and checkpoint_version(run_dir) > 0, 60)
        before, version = json.loads((run_dir / "roles.json").read_text()), checkpoint_version(run_dir)
        os.kill(before[role], signal.SIGKILL)
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
    return before, version, process.returncode, output


def checkpoint_version(run_dir: Path) -> int:
    try:
        return int(torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)["version"])
    except (OSError, RuntimeError, EOFError, KeyError, ValueError):  # not written yet
        return -1


def test_killed_driver_leaves_no_role_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(
        run_dir, "stop.target_return=null", "stop.max_wall_time_s=120", "checkpoint.interval_s=0.5"
    )
    try:
        assert wait_for(
            lambda: (
                (run_dir / "roles.json").exists()
                and checkpoint_version(run_dir) > 0
                and (newest_set(run_dir) / "driver.json").exists()
            ),
            60,
        ), "the run did not get going"
        roles = json.loads((run_dir / "roles.json").read_text())
        os.kill(process.pid, signal.SIGKILL)  # the OOM killer, a scheduler, a closed SSH session
        process.wait(10)
        gone = wait_for(lambda: not any(pid_alive(pid) for pid in roles.values()), seconds=10)
        assert gone, f"role processes outlived their driver: {[n for n, p in roles.items() if pid_alive(p)]}"
    finally:
        if process.poll() is None:
            process.kill()
    assert run_leftovers(process.pid), "a killed driver cannot clean up: its sockets and slot files stay"

    saved = json.loads((newest_set(run_dir) / "driver.json").read_text())
    version = load_learner(run_dir / "checkpoints")["version"]
    more = saved["env_steps"] + 20_000
    result = subprocess.run(
        [sys.executable, "-m", "tianji", "train", "--resume", str(run_dir), "--set", f"stop.max_env_steps={more}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= more and summary["policy_version"] > version
    assert not run_leftovers(process.pid), "the next `tianji train` removes the dead run's leftovers"


def test_killed_learner_restarts_from_its_checkpoint_and_the_run_reaches_its_target(tmp_path):
    run_dir = tmp_path / "run"
    before, restored_from, returncode, output = kill_mid_run(run_dir, "learner0", "stop.max_wall_time_s=120")
    victim = before["learner0"]
    assert returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["target_reached"], summary
    assert summary["learner_restarts"] == 1 and summary["role_restarts"] == 0
    assert json.loads((run_dir / "roles.json").read_text())["learner0"] != victim
    assert_lag_bounded(summary, 8)
    # the new learner started from the checkpoint, not from scratch
    versions = [
        int(float(r["balance/policy_version"]))
        for r in csv.DictReader((run_dir / "metrics.csv").read_text().splitlines())
    ]
    first_past = next(i for i, v in enumerate(versions) if v >= restored_from)
    assert min(versions[first_past:]) >= restored_from


def test_a_restarted_learner_that_keeps_failing_ends_the_run(tmp_path):
    _, _, returncode, output = kill_mid_run(
        tmp_path / "run",
        "learner0",
        "stop.target_return=null",
        "stop.max_wall_time_s=60",
        "supervision.max_learner_restarts=0",
    )
    assert returncode == 1
    assert "learner restarts reached supervision limit 0" in output


def test_sweep_removes_only_files_of_runs_whose_processes_are_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = shm_root()
    mine = folder / f"tianji-0badc0dep{os.getpid()}-actor0-pid{os.getpid()}"  # a live run: kept
    orphan = folder / f"tianji-0badc0dep{dead.pid}-actor0-pid{dead.pid}"
    foreign = folder / "tianji-not-ours"  # not a TianJi run name: never touched
    for path in (mine, orphan, foreign):
        path.write_bytes(b"x")
    try:
        assert run_leftovers(dead.pid) == [orphan]  # one run's files, found by its driver's pid
        removed = sweep_leftovers()
        assert orphan in removed and not orphan.exists()
        assert mine.exists() and foreign.exists()
    finally:
        for path in (mine, orphan, foreign):
            path.unlink(missing_ok=True)


def test_a_process_tree_holds_the_children_of_children_and_a_reaped_one_is_not_alive():
    grandchild = "import subprocess; subprocess.run(['sh', '-c', 'sleep 30; true'])"
    parent = subprocess.Popen([sys.executable, "-c", grandchild])
    try:
        assert wait_for(lambda: len(process_tree(parent.pid)) == 3, 10), process_tree(parent.pid)  # python, sh, sleep
        assert process_tree(os.getpid())[0] == os.getpid() and parent.pid in process_tree(os.getpid())
        assert pid_alive(parent.pid)
    finally:
        for pid in reversed(process_tree(parent.pid)):
            # the sleep's death lets sh run on, end and be reaped before its own kill
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
    assert not pid_alive(parent.pid)


def test_a_file_size_limit_set_from_outside_reaches_a_grandchild_and_lifts(tmp_path):
    """The full disk of the fault tests and the chaos benchmark: set on a running tree, each write past it
    fails with EFBIG; lifted, writes go through again."""
    script = (
        "import pathlib, sys, time\n"
        "for i in range(100):\n"
        "    try:\n"
        f"        pathlib.Path(r'{tmp_path}', f'f{{i}}').write_bytes(b'x' * 4096)\n"
        "    except OSError as e:\n"
        "        print(e.errno, flush=True)\n"
        "    time.sleep(0.05)\n"
    )
    wrapper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {script!r}])"
    parent = subprocess.Popen([sys.executable, "-c", wrapper], stdout=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: len(process_tree(parent.pid)) == 2 and any(tmp_path.iterdir()), 10)
        limit_file_size(parent.pid, 1024)
        time.sleep(0.5)
        limit_file_size(parent.pid, resource.RLIM_INFINITY)
        out, _ = parent.communicate(timeout=30)
    finally:
        parent.kill()
    assert str(errno.EFBIG) in out.split(), out  # the grandchild's writes failed while the limit held
    assert len(list(tmp_path.iterdir())) == 100, "every file made; those written under the limit short"
    assert (tmp_path / "f99").stat().st_size == 4096, "lifted, writes go through again"


def test_driver_survives_a_flood_of_malformed_events_and_logs_a_few(tiny_config, tmp_path, caplog):
    from tianji.runtime.driver.monitor import Monitor
    from tianji.runtime.driver.supervise import _Supervisor
    from tianji.runtime.shared.context import RunContext

    cfg = tiny_config()
    run = RunContext(cfg, tmp_path, t0=time.time(), resumed=False)
    monitor = Monitor(cfg, tmp_path, run.t0)
    ctx = zmq.Context()
    try:
        events, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        for sock in (events, sender):
            sock.set_hwm(0)  # queue the whole flood before the driver reads it
        events.bind("inproc://events")
        sender.connect("inproc://events")
        supervisor = _Supervisor(run, monitor, events, control=None, roles=None)
        for i in range(5000):
            sender.send(b"\x00garbage" if i % 2 else pack_header({"no": "kind"}))
        sender.send(pack_header({"kind": "gossip"}))  # well-formed, but no event of ours
        sender.send(pack_header({"kind": "actor", "env_steps": "many"}))  # a counter that is not a number
        sender.send(pack_header({"kind": "actor", "env_steps": 256}))
        with caplog.at_level(logging.WARNING, logger="tianji"):
            while monitor.env_steps < 256:
                supervisor.drain_events(timeout_ms=1000)
    finally:
        monitor.close()
        ctx.destroy(linger=0)
    assert monitor.counter("bad_messages") == 5002
    warnings = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert 10 <= len(warnings) <= 20, len(warnings)  # the first ten, then every thousandth


def test_slot_reader_opens_only_files_directly_in_the_run_folder(tmp_path):
    token = "tianji-feedbeefp1-"
    inside = shm_root() / f"{token}actor0"
    elsewhere = tmp_path / f"{token}actor0"
    link = shm_root() / f"{token}actor1"
    arrays = {"x": np.arange(4, dtype=np.float32)}
    writers = [SlotWriter(inside, 1), SlotWriter(elsewhere, 1)]
    try:
        header = writers[0].write(0, arrays)
        reader = SlotReader(allowed_prefix=token)
        assert np.array_equal(reader.read(header)["x"], arrays["x"])
        outside = writers[1].write(0, arrays)
        with pytest.raises(WireError, match="is not one of this run's"):
            reader.read(outside)
        link.symlink_to(elsewhere)
        with pytest.raises(WireError, match="cannot open"):  # a link named like ours is not followed
            reader.read({**header, "shm": str(link)})
        reader.close()
    finally:
        for writer in writers:
            writer.close()
        for path in (inside, elsewhere, link):
            path.unlink(missing_ok=True)


def test_a_learner_of_a_group_killed_restarts_the_group_and_the_run_reaches_its_target(tmp_path):
    run_dir = tmp_path / "run"
    before, _, returncode, output = kill_mid_run(run_dir, "learner1", "stop.max_wall_time_s=150", "topology.learners=2")
    assert returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["target_reached"] and summary["learner_restarts"] == 1, summary
    after = json.loads((run_dir / "roles.json").read_text())
    assert after["learner0"] != before["learner0"] and after["learner1"] != before["learner1"], "learners fail together"
    assert after["actor0"] == before["actor0"], "actors keep running and reconnect"
