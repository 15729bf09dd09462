"""Atomic checkpoints that load without unpickling arbitrary objects."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from tianji.runtime.driver.events import checkpoint_notice
from tianji.runtime.transport.wire import pack_header

LEARNER_FILE = "learner.pt"
DRIVER_FILE = "driver.json"


def learner_file(rank: int = 0) -> str:
    """Rank 0 writes learner.pt (the model users load); the other learners of a group their own state."""
    return LEARNER_FILE if rank == 0 else f"learner-rank{rank}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the text names the file and the reason."""


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def save_learner(directory: Path, state: dict[str, Any], rank: int = 0) -> Path:
    path = directory / learner_file(rank)
    _atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def load_learner(directory: Path, rank: int = 0) -> dict[str, Any] | None:
    path = directory / learner_file(rank)
    if not path.exists():
        return None
    return _checked_state(path, path)


def learner_state_from_bytes(data: bytes, source: str) -> dict[str, Any]:
    return _checked_state(io.BytesIO(data), source)


def learner_state_to_bytes(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def save_learner_bytes(directory: Path, data: bytes, rank: int = 0) -> Path:
    """Write a checkpoint that a learner on another machine sent (already serialized)."""
    path = directory / learner_file(rank)
    _atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return path


def _checked_state(source: Any, name: Any) -> dict[str, Any]:
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe files
        raise CheckpointError(f"{name}: not a loadable TianJi checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"algo", "version"} <= set(state):
        raise CheckpointError(f"{name}: expected a learner checkpoint with 'algo' and 'version'")
    return state


def restore_path(directory: Path, rank: int, restart: bool = False) -> Path | None:
    """The checkpoint learner `rank` resumes from (None: it starts fresh). `restart`: its group restarts
    within the run, and a rank killed before writing its first checkpoint starts from rank 0's, the
    group's state at that moment; a user's resume with more learners than the run had is refused."""
    own, first = directory / learner_file(rank), directory / LEARNER_FILE
    if own.exists():
        return own
    if rank > 0 and first.exists():
        if restart:
            return first
        raise CheckpointError(f"{directory}: no {learner_file(rank)}; resume with as many learners "
                              "(topology.learners) as the run had")
    return None


class FileStore:
    """Where a learner on the driver's machine keeps its checkpoint: the run directory itself."""

    def __init__(self, directory: Path, rank: int = 0):
        self.directory, self.rank = directory, rank

    def load(self, restart: bool = False) -> dict[str, Any] | None:
        path = restore_path(self.directory, self.rank, restart)
        return None if path is None else _checked_state(path, path)

    def save(self, state: dict[str, Any]) -> list[bytes]:
        """Write the checkpoint; returns the frames of the notice for the driver."""
        save_learner(self.directory, state, self.rank)
        return [_notice(state, self.rank)]


class ShippedStore:
    """A learner on another machine: it starts from the checkpoint the driver sent (bytes, or none)
    and ships each new one to the driver, which writes the run directory."""

    def __init__(self, restore: bytes | None, rank: int = 0):
        self.restore, self.rank = restore, rank

    def load(self, restart: bool = False) -> dict[str, Any] | None:
        return None if self.restore is None else learner_state_from_bytes(self.restore, "checkpoint from the driver")

    def save(self, state: dict[str, Any]) -> list[bytes]:
        return [_notice(state, self.rank), learner_state_to_bytes(state)]


def _notice(state: dict[str, Any], rank: int) -> bytes:
    return pack_header(checkpoint_notice(int(state["version"]), rank))


def save_driver(directory: Path, state: dict[str, Any]) -> None:
    _atomic_write(directory / DRIVER_FILE, lambda tmp: tmp.write_text(json.dumps(state)))


def load_driver(directory: Path) -> dict[str, Any] | None:
    path = directory / DRIVER_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
