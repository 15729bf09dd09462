"""Checkpoints that can be trusted: verified sets, the last few kept, loaded without unpickling.

    checkpoints/
      staging/learner-r0-v000120-e0.pt   each learner's newest write (atomic), named in its notice
      set-000007/                        a set: every learner's file, driver.json, then manifest.json
        learner.pt  learner-rank1.pt  driver.json  manifest.json

A learner writes its state into `staging/` and tells the driver; the driver makes a set of it: the
learners' newest files (the one just staged moved in, the others of a group copied: no two sets share a
file), its own counters (driver.json), and last a manifest with every file's size and SHA-256 and the
policy version. A set without a manifest is incomplete. The
newest `checkpoint.keep` sets stay; older ones go only after a newer one is complete, so a write that
fails (a full disk) never costs the previous good set.

Reading (`--resume`, a learner restarted within the run, `tianji eval`) takes the newest set that
verifies; a damaged one is named in one line with what is wrong, and the one before it is used.

    sets = CheckpointSets(run_dir / "checkpoints", keep=3)
    staged = sets.stage(learner.state_dict(), rank=0, epoch=0)      # learner: write, then notify
    sets.commit(version, {0: staging / staged}, driver_state, moved=0) # driver: a new verified set
    good = sets.newest_good()                                        # GoodSet(path, ...) or CheckpointError
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tianji.runtime.shared.events import checkpoint_notice
from tianji.runtime.transport.wire import pack_header

log = logging.getLogger("tianji")

LEARNER_FILE = "learner.pt"
DRIVER_FILE = "driver.json"
MANIFEST_FILE = "manifest.json"
STAGING = "staging"
SET_PATTERN = re.compile(r"set-(\d{6})")
STAGED_PATTERN = re.compile(r"learner-r(\d+)-v(\d+)-e(\d+)\.pt")


def learner_file(rank: int = 0) -> str:
    """Rank 0's file is learner.pt (the model users load); the other learners of a group their own state."""
    return LEARNER_FILE if rank == 0 else f"learner-rank{rank}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the text names the file and the reason."""


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (full disk) leaves nothing half-written behind
        raise


def learner_state_to_bytes(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def learner_state_from_bytes(data: bytes, source: str) -> dict[str, Any]:
    return _checked_state(io.BytesIO(data), source)


def _checked_state(source: Any, name: Any) -> dict[str, Any]:
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe files
        raise CheckpointError(f"{name}: not a loadable TianJi checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"algo", "version"} <= set(state):
        raise CheckpointError(f"{name}: expected a learner checkpoint with 'algo' and 'version'")
    return state


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def set_damage(path: Path) -> str | None:
    """What is wrong with the checkpoint set at `path` (None: every file as its manifest says)."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.exists():
        return "incomplete (no manifest.json: the run stopped while writing it)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and files
    except Exception as exc:  # a damaged manifest in any way
        return f"manifest.json is unreadable ({type(exc).__name__})"
    for name, expected in files.items():
        file = path / name
        if not file.exists():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected.get("bytes"):
            return f"{name} is {size:,} bytes, the manifest says {expected.get('bytes'):,} (truncated or replaced)"
        if sha256(file) != expected.get("sha256"):
            return f"{name} does not match its checksum in the manifest (damaged)"
    return None


@dataclass
class GoodSet:
    """A checkpoint set that verified (or, `verified` False, the flat layout of runs from before sets)."""

    path: Path
    policy_version: int | None
    verified: bool = True
    skipped: list[str] = field(default_factory=list)  # one line per newer set that was damaged

    def learner_path(self, rank: int = 0, restart: bool = False) -> Path | None:
        """The file learner `rank` resumes from (None: it starts fresh). `restart`: its group restarts within
        the run, and a rank that had written no checkpoint yet starts from rank 0's, the group's state then;
        a user's resume with more learners than the run had is refused."""
        own, first = self.path / learner_file(rank), self.path / LEARNER_FILE
        if own.exists():
            return own
        if rank > 0 and first.exists():
            if restart:
                return first
            raise CheckpointError(
                f"{self.path}: no {learner_file(rank)}; resume with as many learners (topology.learners) as the run had"
            )
        return None

    def learner_state(self, rank: int = 0, restart: bool = False) -> dict[str, Any] | None:
        path = self.learner_path(rank, restart)
        return None if path is None else _checked_state(path, path)

    def driver_state(self) -> dict[str, Any] | None:
        path = self.path / DRIVER_FILE
        if not path.exists():
            return None
        try:
            state: dict[str, Any] = json.loads(path.read_text())
            return state
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


class CheckpointSets:
    """The checkpoint sets of one run directory (`checkpoints/`)."""

    def __init__(self, directory: Path, keep: int = 3):
        self.directory = Path(directory)
        self.keep = keep

    # ---------------------------------------------------------------- writing

    def stage(self, state: dict[str, Any], rank: int, epoch: int) -> str:
        """Write a learner's state into staging/ (atomically); returns the file's name for the notice.
        Raises OSError when the disk cannot take it."""
        name = f"learner-r{rank}-v{int(state['version']):06d}-e{epoch}.pt"
        data = learner_state_to_bytes(state)  # serialized first: torch.save to a full disk raises RuntimeError
        _atomic_write(self.directory / STAGING / name, lambda tmp: tmp.write_bytes(data))
        return name

    def stage_bytes(self, data: bytes, rank: int, version: int, epoch: int) -> str:
        """A checkpoint a learner on another machine shipped (already serialized)."""
        name = f"learner-r{rank}-v{version:06d}-e{epoch}.pt"
        _atomic_write(self.directory / STAGING / name, lambda tmp: tmp.write_bytes(data))
        return name

    def commit(
        self, version: int, files: dict[int, Path], driver_state: dict[str, Any], moved: int | None = None
    ) -> dict[int, Path]:
        """A new set: each learner's newest file (rank -> where it is now; rank `moved`'s, just staged, is
        moved in, the others copied: no two sets share a file, so damage to one stays in one), the driver's
        counters, and last the manifest; then the sets beyond `keep` go. Returns where each file now is.
        On a failed write (OSError) the incomplete set is removed and the error raised: the sets before it
        are untouched."""
        path = self.directory / f"set-{self._next_number():06d}"
        placed: dict[int, Path] = {}
        try:
            path.mkdir(parents=True)
            for rank, source in sorted(files.items()):
                placed[rank] = path / learner_file(rank)
                if rank == moved:
                    os.replace(source, placed[rank])
                else:
                    shutil.copyfile(source, placed[rank])
            self._seal(path, version, driver_state)
        except OSError:
            if moved in placed and placed[moved].exists():
                os.replace(placed[moved], files[moved])  # back where it was: the next set may still take it
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._prune()
        return placed

    def reseal_newest(self, driver_state: dict[str, Any]) -> Path | None:
        """At the end of a run: the newest set takes the driver's final counters (a new driver.json, then a
        new manifest; each replaced atomically). None when there is no set."""
        complete = self._complete_sets()
        if not complete:
            return None
        manifest = json.loads((complete[-1] / MANIFEST_FILE).read_text())
        self._seal(complete[-1], int(manifest["policy_version"]), driver_state)
        return complete[-1]

    def _seal(self, path: Path, version: int, driver_state: dict[str, Any]) -> None:
        """driver.json, then the manifest of every file in the set (written last)."""
        _atomic_write(path / DRIVER_FILE, lambda tmp: tmp.write_text(json.dumps(driver_state)))
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
            for f in sorted(path.iterdir())
            if not f.name.startswith(".") and f.name != MANIFEST_FILE
        }
        manifest = {"format": 1, "policy_version": version, "created": time.time(), "files": files}
        _atomic_write(path / MANIFEST_FILE, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))

    def _next_number(self) -> int:
        numbers = [int(m.group(1)) for p in self._sets() if (m := SET_PATTERN.fullmatch(p.name))]
        return max(numbers, default=0) + 1

    def _sets(self) -> list[Path]:
        """Set directories, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.is_dir() and SET_PATTERN.fullmatch(p.name))

    def _complete_sets(self) -> list[Path]:
        return [p for p in self._sets() if (p / MANIFEST_FILE).exists()]

    def _prune(self) -> None:
        """Keep the newest `keep` complete sets; incomplete ones go once a newer set is complete."""
        complete = self._complete_sets()
        kept = set(complete[-self.keep :])
        newest = complete[-1] if complete else None
        for path in self._sets():
            if path not in kept and newest is not None and path < newest:
                shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------- reading

    def newest_good(self) -> GoodSet:
        """The newest set that verifies (see `find_good`); CheckpointError when there is none."""
        good = self.find_good()
        if good is None:
            raise CheckpointError(f"no checkpoint in {self.directory} yet; train first")
        return good

    def find_good(self) -> GoodSet | None:
        """The newest set that verifies; each damaged newer one is named in `skipped`, one line each. Runs
        from before sets (a flat checkpoints/learner.pt) are read as they are. None when there is nothing to
        resume from; CheckpointError naming what is wrong with each set when sets exist but none is good."""
        sets = self._sets()
        skipped: list[str] = []
        for path in reversed(sets):
            damage = set_damage(path)
            if damage is None:
                manifest = json.loads((path / MANIFEST_FILE).read_text())
                return GoodSet(path, manifest.get("policy_version"), True, skipped)
            skipped.append(f"checkpoint {path.name}: {damage}")
        if sets:
            raise CheckpointError(f"no good checkpoint set in {self.directory} ({'; '.join(skipped)})")
        if (self.directory / LEARNER_FILE).exists():
            return GoodSet(self.directory, None, verified=False)
        return None


# ---------------------------------------------------------------- what roles and tools call


def load_learner(directory: Path, rank: int = 0) -> dict[str, Any] | None:
    """The learner state in the newest good set of `directory` (None: no checkpoint yet)."""
    good = CheckpointSets(directory).find_good()
    return None if good is None else good.learner_state(rank)


def load_driver(directory: Path) -> dict[str, Any] | None:
    good = CheckpointSets(directory).find_good()
    return None if good is None else good.driver_state()


class FileStore:
    """Where a learner on the driver's machine keeps its checkpoints: the run directory itself."""

    def __init__(self, directory: Path, rank: int = 0, epoch: int = 0):
        self.sets, self.rank, self.epoch = CheckpointSets(directory), rank, epoch

    def load(self, restart: bool = False) -> dict[str, Any] | None:
        good = self.sets.find_good()
        for line in [] if good is None else good.skipped:
            log.warning("%s; learner%d resumes from an older set", line, self.rank)
        return None if good is None else good.learner_state(self.rank, restart)

    def save(self, state: dict[str, Any]) -> list[bytes]:
        """Stage the checkpoint; returns the frames of the notice for the driver (a failure notice when the
        disk refused it: training goes on, the last good set stays)."""
        version = int(state["version"])
        try:
            name = self.sets.stage(state, self.rank, self.epoch)
        except OSError as exc:
            failed = describe_os_error(exc, self.sets.directory / STAGING)
            return [pack_header(checkpoint_notice(version, self.rank, failed=failed))]
        return [pack_header(checkpoint_notice(version, self.rank, staged=name, epoch=self.epoch))]


class ShippedStore:
    """A learner on another machine: it starts from the checkpoint the driver sent (bytes, or none)
    and ships each new one to the driver, which stages it in the run directory."""

    def __init__(self, restore: bytes | None, rank: int = 0, epoch: int = 0):
        self.restore, self.rank, self.epoch = restore, rank, epoch

    def load(self, restart: bool = False) -> dict[str, Any] | None:
        return None if self.restore is None else learner_state_from_bytes(self.restore, "checkpoint from the driver")

    def save(self, state: dict[str, Any]) -> list[bytes]:
        notice = checkpoint_notice(int(state["version"]), self.rank, epoch=self.epoch)
        return [pack_header(notice), learner_state_to_bytes(state)]


def describe_os_error(exc: OSError, where: Path | str | None = None) -> str:
    """'ENOSPC (No space left on device): checkpoints/staging/...': the reason and the path, in one line."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    path = exc.filename or where
    return f"{code} ({exc.strerror}): {path}" if path else f"{code} ({exc.strerror})"
