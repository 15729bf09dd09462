"""The driver's side of checkpoints: every learner notice becomes a verified set (once rank 0 has one),
failed writes are counted and logged, and the run's end leaves a last set with the final counters.

    keeper = CheckpointKeeper(run, monitor)
    keeper.on_notice(notice, payload)     # a learner staged a checkpoint (or shipped its bytes)
    keeper.final()                        # at the end: the newest learner files with the final counters
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.shared.checkpoint import STAGING, CheckpointSets, describe_os_error
from tianji.runtime.shared.context import RunContext

log = logging.getLogger("tianji")


class CheckpointKeeper:
    def __init__(self, run: RunContext, monitor: Monitor):
        self.sets = CheckpointSets(run.checkpoint_dir, run.cfg.checkpoint.keep)
        self.monitor = monitor
        self.interval_s = run.cfg.checkpoint.interval_s
        self.files: dict[int, Path] = {}  # rank -> where its newest checkpoint file is (staging/ or a set)
        self.version_0 = 0  # rank 0's newest version (the sets' policy version)
        self._last_logged = 0.0

    def on_notice(self, notice: dict[str, Any], payload: list[bytes]) -> None:
        rank, version = int(notice.get("rank", 0)), int(notice.get("version", 0))
        if "failed" in notice:
            self._failed(f"learner{rank}'s checkpoint", notice["failed"])
            return
        try:
            if payload:  # from a learner on another machine
                name = self.sets.stage_bytes(payload[0], rank, version, int(notice.get("epoch", 0)))
            elif isinstance(notice.get("staged"), str):
                name = notice["staged"]
            else:
                return
            self.files[rank] = self.sets.directory / STAGING / name
            if 0 in self.files:  # every notice makes a set (once rank 0 has a file): each learner's newest file
                self.version_0 = version if rank == 0 else self.version_0
                self.files = self.sets.commit(self.version_0, self.files, self.monitor.state(), moved=rank)
        except OSError as exc:
            self._failed("checkpoint set", describe_os_error(exc, self.sets.directory))

    def final(self) -> None:
        """The newest set takes the driver's final counters."""
        try:
            self.sets.reseal_newest(self.monitor.state())
        except OSError as exc:
            self._failed("final checkpoint counters", describe_os_error(exc, self.sets.directory))

    def _failed(self, what: str, reason: str) -> None:
        """Count every failed write; log at most one line per checkpoint interval (training goes on)."""
        failures = self.monitor.count("checkpoint_write_failures")
        if time.time() - self._last_logged >= self.interval_s:
            log.warning(
                "%s not written: %s; training goes on, the last good set stays (%d failed writes so far)",
                what,
                reason,
                int(failures),
            )
            self._last_logged = time.time()
