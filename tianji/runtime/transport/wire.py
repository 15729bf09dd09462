"""Binary wire format: a msgpack header plus raw array buffers. No pickle.

A message is a list of frames: frame 0 is a msgpack map that always has `kind`
and, when arrays travel, `fields`: `[[name, dtype, shape], ...]`. Each later
frame is the raw C-order buffer of one array, in the order of `fields`.

    frames = encode({"kind": "weights", "version": 3}, {"w": np.zeros(4, np.float32)})
    header, arrays = decode(frames)

`decode` trusts nothing: a wrong frame count, an unknown dtype or a buffer whose
size does not match its shape raises `WireError` with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

# Only plain numeric dtypes may cross the wire (never object arrays).
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str for t in ("bool", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8")
)
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 8


class WireError(ValueError):
    """A message that cannot be decoded; the text says why."""


def describe(arrays: Mapping[str, np.ndarray]) -> list[list[Any]]:
    return [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> list[Any]:
    """Header frame followed by one zero-copy buffer per array."""
    arrays = arrays or {}
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    head = dict(header)
    head["fields"] = describe(contiguous)
    frames: list[Any] = [pack_header(head)]
    return frames + [memoryview(a.data).cast("B") if a.size else b"" for a in contiguous.values()]


def pack_header(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: Any) -> dict[str, Any]:
    data = bytes(frame)
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError("header must be a map with a string 'kind'")
    return header


def check_fields(fields: Any) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    """Validate a `fields` list; returns (name, dtype, shape, nbytes) per array."""
    if not isinstance(fields, list):
        raise WireError("'fields' must be a list")
    checked = []
    for entry in fields:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise WireError(f"field entry {entry!r} must be [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str):
            raise WireError(f"field name {name!r} must be a string")
        if dtype not in ALLOWED_DTYPES:
            raise WireError(f"field {name!r}: dtype {dtype!r} not allowed")
        if not (
            isinstance(shape, list) and len(shape) <= MAX_DIMS and all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise WireError(f"field {name!r}: shape {shape!r} must be a list of non-negative ints")
        dt = np.dtype(dtype)
        checked.append((name, dt, tuple(shape), int(np.prod(shape, dtype=np.int64)) * dt.itemsize))
    return checked


def decode(frames: Sequence[Any], copy: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of `encode`. Arrays are read-only views of the frames unless `copy`."""
    if not frames:
        raise WireError("empty message")
    header = unpack_header(frames[0])
    fields = check_fields(header.get("fields", []))
    if len(frames) != 1 + len(fields):
        raise WireError(f"expected {1 + len(fields)} frames for {len(fields)} arrays, got {len(frames)}")
    arrays = {}
    for (name, dt, shape, nbytes), frame in zip(fields, frames[1:], strict=False):
        buf = memoryview(frame).cast("B") if not isinstance(frame, bytes) else frame
        if len(buf) != nbytes:
            raise WireError(f"field {name!r}: {len(buf)} bytes, expected {nbytes} for {dt.str}{list(shape)}")
        arr = np.frombuffer(buf, dtype=dt).reshape(shape)
        arrays[name] = arr.copy() if copy else arr
    return header, arrays
