"""Atomic checkpoints that load without unpickling arbitrary objects."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

LEARNER_FILE = "learner.pt"
DRIVER_FILE = "driver.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the text names the file and the reason."""


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def save_learner(directory: Path, state: dict[str, Any]) -> Path:
    path = directory / LEARNER_FILE
    _atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def load_learner(directory: Path) -> dict[str, Any] | None:
    path = directory / LEARNER_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe files
        raise CheckpointError(f"{path}: not a loadable TianJi checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"algo", "version"} <= set(state):
        raise CheckpointError(f"{path}: expected a learner checkpoint with 'algo' and 'version'")
    return state


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
