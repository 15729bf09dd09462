"""Shared-memory fragment slots: data stays put, only slot indices travel.

Each actor owns one file under /dev/shm holding `slots` equally sized slots
(its credits). It writes a fragment's rows straight into a granted slot (after
the first fragment has fixed the layout: `SlotWriter.views`) and sends a small
header naming the file and slot; the learner copies the arrays out once and
returns the credit. The driver removes every file of a run when it ends.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tianji.runtime.transport.wire import WireError, check_fields, describe

ALIGN = 64


def shm_root() -> Path:
    root = Path("/dev/shm")
    return root if root.is_dir() and os.access(root, os.W_OK) else Path(tempfile.gettempdir())


def pool_path(run_token: str, owner: str) -> Path:
    return shm_root() / f"tianji-{run_token}-{owner}"


def remove_pools(run_token: str) -> None:
    for path in shm_root().glob(f"tianji-{run_token}-*"):
        path.unlink(missing_ok=True)


def _layout(fields: list[tuple[str, np.dtype, tuple[int, ...], int]]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for *_, nbytes in fields:
        offsets.append(pos)
        pos += -(-nbytes // ALIGN) * ALIGN
    return offsets, max(pos, ALIGN)


class SlotWriter:
    """Actor side: a file of `slots` fragment slots, created on first write."""

    def __init__(self, path: Path, slots: int):
        self.path, self.slots = path, slots
        self._map: mmap.mmap | None = None
        self._fields: list[Any] | None = None
        self._offsets: list[int] = []
        self.slot_bytes = 0

    def write(self, slot: int, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Copy arrays into `slot`; returns the header fields that locate them."""
        fields = describe(arrays)
        if self._map is None or fields != self._fields:
            self._open(fields)
        base = slot * self.slot_bytes
        assert self._map is not None  # opened above
        for offset, arr in zip(self._offsets, arrays.values(), strict=True):
            dst = np.frombuffer(self._map, dtype=arr.dtype, count=arr.size, offset=base + offset)
            dst[...] = arr.reshape(-1)
        return self.header(slot)

    def views(self, slot: int) -> dict[str, np.ndarray] | None:
        """Arrays laid out like the last write, living in `slot`: fill them in place, then send
        `header(slot)` (no copy at all). None until a first write has fixed the layout."""
        if self._map is None or self._fields is None:
            return None
        base = slot * self.slot_bytes
        return {
            name: np.frombuffer(self._map, dtype=dt, count=nbytes // dt.itemsize, offset=base + offset).reshape(shape)
            for (name, dt, shape, nbytes), offset in zip(check_fields(self._fields), self._offsets, strict=True)
        }

    def header(self, slot: int) -> dict[str, Any]:
        return {"shm": str(self.path), "slot": slot, "slot_bytes": self.slot_bytes, "fields": self._fields}

    def _open(self, fields: list[Any]) -> None:
        self.close()
        self._offsets, needed = _layout(check_fields(fields))
        # never shrink the file: a reader that mapped the old size would fault past the new end
        self.slot_bytes = max(self.slot_bytes, needed)
        size = self.slot_bytes * self.slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._fields = fields

    def close(self) -> None:
        if self._map is not None:
            release(self._map)
            self._map = None


class SlotReader:
    """Learner side: maps actors' slot files on demand and copies fragments out.

    Only files directly in the run's shared-memory folder whose names start with the run's
    prefix are opened, never through a symbolic link: a notice cannot make the learner read
    anything else.
    """

    def __init__(self, allowed_prefix: str, folder: Path | None = None):
        self.allowed_prefix = allowed_prefix
        self.folder = (folder or shm_root()).resolve()
        self._maps: dict[str, mmap.mmap] = {}

    def _is_ours(self, path: Any) -> bool:
        if not isinstance(path, str):
            return False
        candidate = Path(path)
        return candidate.name.startswith(self.allowed_prefix) and candidate.parent.resolve() == self.folder

    def read(self, header: Mapping[str, Any], copy: bool = True) -> dict[str, np.ndarray]:
        """The fragment's arrays: copies, or (`copy=False`) read-only views of the slot, valid until
        the slot is granted to its actor again."""
        path, slot, slot_bytes = header.get("shm"), header.get("slot"), header.get("slot_bytes")
        if not isinstance(path, str) or not self._is_ours(path):
            raise WireError(f"shared-memory path {path!r} is not one of this run's")
        if not (isinstance(slot, int) and isinstance(slot_bytes, int) and slot >= 0 and slot_bytes > 0):
            raise WireError("'slot' and 'slot_bytes' must be non-negative ints")
        fields = check_fields(header.get("fields"))
        offsets, needed = _layout(fields)
        if needed > slot_bytes:
            raise WireError(f"fields need {needed} bytes but slot_bytes is {slot_bytes}")
        buf = self._map_for(path, (slot + 1) * slot_bytes)
        base = slot * slot_bytes
        out = {}
        for (name, dt, shape, nbytes), offset in zip(fields, offsets, strict=False):
            view = np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize, offset=base + offset)
            out[name] = view.reshape(shape).copy() if copy else view.reshape(shape)
        return out

    def _map_for(self, path: str, min_size: int) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None or len(m) < min_size:
            if m is not None:
                release(m)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                raise WireError(f"cannot open shared memory {path}: {exc.strerror}") from None
            try:
                size = os.fstat(fd).st_size
                if size < min_size:
                    raise WireError(f"slot beyond end of {path} ({size} < {min_size} bytes)")
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[path] = m
        return m

    def close(self) -> None:
        for m in self._maps.values():
            release(m)
        self._maps.clear()


def release(m: mmap.mmap) -> None:
    """Unmap now, or, while arrays still view it (a batch the learner is training on, a fragment the actor
    is writing), when the last of them goes: closing under them raises BufferError."""
    with contextlib.suppress(BufferError):
        m.close()
