"""One trial: an ordinary `tianji train` run in its own process group, followed through its metrics.

    process = TrialProcess(command, run_dir, cores=[0])
    process.start()
    rows = process.new_rows()      # metrics rows written since the last call (metrics.jsonl)
    process.interrupt()            # SIGINT: the run stops cleanly (final checkpoint, summary.json)
    process.kill()                 # SIGKILL to the whole group: for a run that ignored the interrupt

A subprocess, not a function call: a trial that crashes, leaks memory or hangs cannot take the sweep
with it, and its run directory is like any other (`tianji plot/eval/train --resume` work on it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tianji.runtime.process.life import die_with_parent

LOG_NAME = "train.log"  # the trial's stdout and stderr, in its run directory


def _prepare_child(cores: list[int] | None, sweep_pid: int) -> None:
    """In the trial's process before exec: pin it to its cores (its roles inherit them), and have the
    kernel send it SIGTERM (which `tianji train` treats as Ctrl-C) when the sweep dies, so that a
    killed sweep leaves trials that stopped cleanly with a checkpoint, not orphans still training."""
    if cores:
        os.sched_setaffinity(0, cores)
    die_with_parent(sweep_pid)


def train_command(
    config: Path,
    run_dir: Path,
    overrides: list[str],
    launcher: str = "local",
    address: str | None = None,
    resume: bool = False,
) -> list[str]:
    """The command a trial runs: `python -m tianji train` on the sweep's base config (or --resume of an
    interrupted trial's run) with the trial's values as --set overrides."""
    command = [sys.executable, "-m", "tianji", "train"]
    command += ["--resume", str(run_dir)] if resume else [str(config), "--run-dir", str(run_dir)]
    command += ["--launcher", launcher]
    if address:
        command += ["--address", address]
    for item in overrides:
        command += ["--set", item]
    return command


class TrialProcess:
    """A trial's process and its metrics file; every call returns at once (the sweep polls many)."""

    def __init__(self, command: list[str], run_dir: Path, cores: list[int] | None = None):
        self.command = command
        self.run_dir = run_dir
        self.cores = cores
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self.interrupted_at: float | None = None
        self._offset = 0  # bytes of metrics.jsonl already read
        self._partial = b""

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = self.run_dir / "metrics.jsonl"
        self._offset = metrics.stat().st_size if metrics.exists() else 0  # a resumed run appends
        log = open(self.run_dir / LOG_NAME, "ab")  # noqa: SIM115  (the trial's output until it ends; closed in wait)
        cores, sweep_pid = self.cores, os.getpid()
        # its own session: the terminal's Ctrl-C reaches the sweep only, which stops each trial cleanly
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: _prepare_child(cores, sweep_pid),
        )
        log.close()
        self.started = time.time()

    def elapsed(self) -> float:
        return time.time() - self.started

    def poll(self) -> int | None:
        """The exit code once the trial's driver has exited, else None."""
        assert self.process is not None
        return self.process.poll()

    def new_rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line still being written
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def interrupt(self) -> None:
        """Ask the run to stop as Ctrl-C would (its driver writes the checkpoint and summary)."""
        if self.interrupted_at is None:
            self.interrupted_at = time.time()
        self._signal(signal.SIGINT, group=False)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, group=True)

    def _signal(self, signum: int, group: bool) -> None:
        assert self.process is not None
        try:
            if group:
                os.killpg(self.process.pid, signum)
            elif self.process.poll() is None:
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def reap(self) -> None:
        """After the driver exited: make sure no role of its group outlives it."""
        self.kill()
        if self.process is not None:
            self.process.wait()

    def log_tail(self, lines: int = 5) -> str:
        path = self.run_dir / LOG_NAME
        if not path.exists():
            return ""
        text = path.read_bytes()[-4000:].decode(errors="replace")
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def summary(self) -> dict[str, Any] | None:
        path = self.run_dir / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
