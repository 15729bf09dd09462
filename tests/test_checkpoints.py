"""Checkpoints that can be trusted: verified sets with fallback, a resume that resumes everything, and a
full disk that costs writes, never the run or the last good set."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tianji.config import build_config
from tianji.runtime.process.life import limit_file_size
from tianji.runtime.roles.build import build_learner
from tianji.runtime.shared.checkpoint import CheckpointSets, set_damage
from tianji.tools.evaluate import evaluate_run
from tianji.tools.train import train

from conftest import newest_set, wait_for


def sets_of(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("set-*"))


def trained(tiny_config, tmp_path, steps: int = 3072, **overrides) -> tuple[Path, dict]:
    cfg = tiny_config(max_env_steps=steps)
    cfg = build_config({**cfg.model_dump(mode="json"), "checkpoint": {"interval_s": 0.01, "keep": 3}, **overrides})
    return train(cfg, "inline", run_dir=str(tmp_path / "run"))


def resume(run_dir: Path, *overrides: str, launcher: str = "local") -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "tianji",
        "train",
        "--resume",
        str(run_dir),
        "--launcher",
        launcher,
        "--set",
        "logging.console=false",
    ]
    for item in overrides:
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_newest_sets_are_kept_each_with_a_manifest_of_sizes_checksums_and_version(tiny_config, tmp_path):
    run_dir, summary = trained(tiny_config, tmp_path)
    sets = sets_of(run_dir)
    assert len(sets) == 3  # checkpoint.keep
    for path in sets:
        assert set_damage(path) is None
        manifest = json.loads((path / "manifest.json").read_text())
        assert set(manifest["files"]) == {"learner.pt", "driver.json"}
        assert manifest["files"]["learner.pt"]["bytes"] == (path / "learner.pt").stat().st_size
    last = json.loads((sets[-1] / "manifest.json").read_text())
    assert last["policy_version"] == summary["policy_version"]


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda s: (s / "learner.pt").write_bytes((s / "learner.pt").read_bytes()[:100]),
            "learner.pt is 100 bytes, the manifest says",
        ),
        (lambda s: (s / "manifest.json").unlink(), "incomplete (no manifest.json"),
        (lambda s: (s / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
        (
            lambda s: (s / "driver.json").write_text((s / "driver.json").read_text().replace("1", "2", 1)),
            "driver.json does not match its checksum",
        ),
    ],
)
def test_a_damaged_newest_set_is_named_in_one_line_and_the_one_before_resumes(tiny_config, tmp_path, damage, expected):
    run_dir, first = trained(tiny_config, tmp_path)
    *_, before, newest = sets_of(run_dir)
    before_version = json.loads((before / "manifest.json").read_text())["policy_version"]
    newest_version = json.loads((newest / "manifest.json").read_text())["policy_version"]
    damage(newest)
    rows_before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    result = resume(run_dir, f"stop.max_env_steps={first['env_steps'] + 1024}")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if newest.name in line and "warning" in line]
    assert len(warnings) == 1 and expected in warnings[0], result.stderr
    assert "Traceback" not in result.stderr
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()[rows_before:]
    versions = [json.loads(line)["balance/policy_version"] for line in rows]
    assert versions and min(versions) >= before_version  # after the resume the version never dips below the set's
    assert before_version <= newest_version


def test_no_good_set_exits_2_with_one_clear_line_and_no_traceback(tiny_config, tmp_path):
    run_dir, _ = trained(tiny_config, tmp_path)
    for path in sets_of(run_dir):
        (path / "learner.pt").write_bytes(b"")
    result = resume(run_dir)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no good checkpoint set in"), result.stderr
    assert "learner.pt is 0 bytes" in lines[0]


def test_eval_plays_the_newest_good_set(tiny_config, tmp_path):
    run_dir, _ = trained(tiny_config, tmp_path)
    *_, before, newest = sets_of(run_dir)
    (newest / "learner.pt").write_bytes(b"junk")
    result = evaluate_run(run_dir, episodes=2)
    assert result["policy_version"] == torch.load(before / "learner.pt", weights_only=True)["version"]


def test_a_restarted_learner_reads_the_newest_good_set(tiny_config, tmp_path):
    from tianji.runtime.shared.checkpoint import FileStore

    run_dir, _ = trained(tiny_config, tmp_path)
    *_, before, newest = sets_of(run_dir)
    (newest / "manifest.json").unlink()
    state = FileStore(run_dir / "checkpoints").load(restart=True)
    assert state["version"] == torch.load(before / "learner.pt", weights_only=True)["version"]


def flat(state, prefix: str = "") -> dict[str, object]:
    """Every tensor and number of a (nested) state, by path."""
    out: dict[str, object] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(flat(value, f"{prefix}{key}/"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(flat(value, f"{prefix}{i}/"))
    else:
        out[prefix] = state
    return out


def assert_same_state(a: dict, b: dict) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        if isinstance(fa[key], torch.Tensor):
            assert torch.equal(fa[key], fb[key]), key
        else:
            assert fa[key] == fb[key], key


def test_a_learner_built_from_a_checkpoint_holds_exactly_its_state(tiny_config, tmp_path):
    """Weights, optimizer moments and step count, version, update and env-step counters (the schedule's position)."""
    cfg = build_config(
        {
            **tiny_config().model_dump(mode="json"),
            "algo": {"name": "ppo", "epochs": 2, "minibatches": 2, "lr_schedule": "linear", "lr_horizon": 50_000},
        }
    )
    run_dir, _ = train(cfg, "inline", run_dir=str(tmp_path / "run"))
    saved = torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)
    learner = build_learner(cfg, saved)
    assert_same_state(learner.state_dict(), saved)
    assert saved["algo"]["optimizer"]["steps"] > 0 and saved["env_steps_consumed"] > 0
    # the learning-rate schedule goes on from where it was: the next update's rate counts the checkpoint's env steps
    fragment = {
        "obs": np.zeros((16, 4, 4), np.float32),
        "action": np.zeros((16, 4), np.int64),
        "logp": np.full((16, 4), -0.69, np.float32),
        "value": np.zeros((16, 4), np.float32),
        "reward": np.ones((16, 4), np.float32),
        "terminated": np.zeros((16, 4), bool),
        "done": np.zeros((16, 4), bool),
        "valid": np.ones((16, 4), bool),
        "bootstrap_value": np.zeros(4, np.float32),
        "last_obs": np.zeros((4, 4), np.float32),
    }
    from tianji.runtime.roles.actor import Fragment

    learner.consume(Fragment(fragment, 0, 0, learner.version, 64))
    stats = learner.update()
    expected = cfg.algo.lr * (1 - (saved["env_steps_consumed"] + 64) / 50_000)
    assert stats["lr"] == pytest.approx(expected, rel=1e-9)


def test_a_resume_that_trains_nothing_ends_with_the_checkpoint_it_read(tiny_config, tmp_path):
    """Resume a finished run without room for more steps (inline: deterministically no update): the set it
    ends with must equal the one it read, exactly (a learner that skipped the optimizer's moments, its step
    count or a counter would differ)."""
    run_dir, first = trained(tiny_config, tmp_path)
    read = torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)
    sets_before = sets_of(run_dir)
    result = resume(run_dir, f"stop.max_env_steps={first['env_steps']}", launcher="inline")
    assert result.returncode == 0, result.stderr
    assert sets_of(run_dir)[-1] not in sets_before  # the resumed learner wrote its own final set
    assert_same_state(torch.load(newest_set(run_dir) / "learner.pt", weights_only=True), read)


# ---------------------------------------------------------------- a full disk, for real


class SmallFilesystem:
    """A 48 MB tmpfs under the run, filled to the last byte: the disk really is full (root only)."""

    reason = "ENOSPC"

    def __init__(self, root: Path):
        self.path = root / "disk"
        self.filler = self.path / "filler"

    def mount(self) -> bool:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(self.path)]
        return subprocess.run(mount, capture_output=True).returncode == 0

    def fill(self, pid: int) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT)
        try:
            for block in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * block)
        finally:
            os.close(fd)

    def free(self, pid: int) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class FileSizeLimit:
    """Every process of the run may grow no file past 1 kB (RLIMIT_FSIZE, set from outside with prlimit):
    each write past that fails with EFBIG, as on a full disk. Needs no privilege."""

    reason = "EFBIG"

    def __init__(self, root: Path):
        self.path = root / "disk"

    def mount(self) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        return hasattr(resource, "prlimit")

    def fill(self, pid: int) -> None:
        limit_file_size(pid, 1024)

    def free(self, pid: int) -> None:
        limit_file_size(pid, resource.RLIM_INFINITY)

    def unmount(self) -> None:
        pass


@pytest.mark.parametrize(  # the same behaviour under two kinds of full disk; the root-only one in the slow tier
    "disk_kind",
    [pytest.param(SmallFilesystem, marks=pytest.mark.slow), FileSizeLimit],
    ids=["tmpfs", "file-size-limit"],
)
def test_a_full_disk_costs_writes_not_the_run_nor_the_last_good_set(tmp_path, disk_kind):
    disk = disk_kind(tmp_path)
    if not disk.mount():
        pytest.skip("needs root to mount a small tmpfs")
    try:
        run_dir = disk.path / "run"
        command = [
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
            "logging.console=false",
            "--set",
            "logging.interval_s=0.2",
            "--set",
            "checkpoint.interval_s=0.3",
            "--set",
            "logging.tensorboard=false",
        ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert wait_for(lambda: len(sets_of(run_dir)) >= 2, 60), "no checkpoint set written"
        disk.fill(process.pid)
        time.sleep(4)  # several checkpoints and metric rows meet a full disk
        good_before = CheckpointSets(run_dir / "checkpoints").newest_good()
        assert good_before.skipped == [], good_before.skipped
        disk.free(process.pid)

        def written_again() -> bool:
            return CheckpointSets(run_dir / "checkpoints").newest_good().path != good_before.path

        assert wait_for(written_again, 30), "no checkpoint set written once the disk had room again"
        process.send_signal(signal.SIGINT)  # the run went on through the full disk: end it as a user would
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["checkpoint_write_failures"] > 0 and summary["metrics_write_failures"] > 0, summary
        assert summary["stop_reason"] == "interrupted"
        warnings = [line for line in output.splitlines() if f"not written: {disk.reason}" in line]
        assert 1 <= len(warnings) <= 2 * 4 / 0.2, output  # at most once per interval, with the reason
        assert str(run_dir) in warnings[0]
        assert CheckpointSets(run_dir / "checkpoints").newest_good().skipped == []
    finally:
        disk.unmount()
