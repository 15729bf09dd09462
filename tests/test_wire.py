"""Wire format round trips and rejection of malformed messages; shared-memory slots."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from tianji.runtime.transport.shm import SlotReader, SlotWriter, pool_path, remove_pools
from tianji.runtime.transport.wire import WireError, decode, encode, pack_header


def sample_arrays():
    rng = np.random.default_rng(0)
    return {
        "obs": rng.integers(0, 255, (32, 8, 84, 84, 4), dtype=np.uint8),
        "reward": rng.normal(size=(32, 8)).astype(np.float32),
        "done": rng.random((32, 8)) < 0.1,
        "action": rng.integers(0, 6, (32, 8)),
        "empty": np.zeros((0, 3), np.float64),
    }


def test_round_trip_preserves_header_and_arrays():
    arrays = sample_arrays()
    frames = encode({"kind": "fragment", "version": 7, "actor": 3}, arrays)
    header, out = decode([bytes(f) for f in frames])
    assert header["kind"] == "fragment" and header["version"] == 7 and header["actor"] == 3
    assert list(out) == list(arrays)
    for name, arr in arrays.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name], arr)


def test_non_contiguous_arrays_are_sent_contiguously():
    a = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2]
    _, out = decode([bytes(f) for f in encode({"kind": "x"}, {"a": a})])
    np.testing.assert_array_equal(out["a"], a)


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([], "empty"),
        ([b"\xc1garbage"], "msgpack"),
        ([pack_header({"no_kind": 1})], "kind"),
        ([msgpack.packb([1, 2, 3])], "kind"),
        ([pack_header({"kind": "w", "fields": [["a", "|O", [1]]]}), b"x" * 8], "dtype"),
        ([pack_header({"kind": "w", "fields": [["a", "<f4", [-1]]]}), b""], "shape"),
        ([pack_header({"kind": "w", "fields": [["a", "<f4", [4]]]})], "frames"),
        ([pack_header({"kind": "w", "fields": [["a", "<f4", [4]]]}), b"\0" * 15], "bytes"),
        ([pack_header({"kind": "w", "fields": "nope"})], "list"),
    ],
)
def test_malformed_messages_are_rejected_with_reason(frames, reason):
    with pytest.raises(WireError, match=reason):
        decode(frames)


def test_truncated_array_frame_is_rejected():
    frames = [bytes(f) for f in encode({"kind": "weights"}, {"w": np.ones(100, np.float32)})]
    frames[1] = frames[1][:-4]
    with pytest.raises(WireError, match="expected 400"):
        decode(frames)


def test_shared_memory_slots_round_trip_and_reuse():
    token = "testslots"
    writer = SlotWriter(pool_path(token, "actor0"), slots=2)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    try:
        arrays = sample_arrays()
        h0 = writer.write(0, arrays)
        h1 = writer.write(1, {k: v[::-1].copy() for k, v in arrays.items()})
        for header, expected in ((h0, arrays), (h1, {k: v[::-1] for k, v in arrays.items()})):
            out = reader.read(header)
            for name in arrays:
                np.testing.assert_array_equal(out[name], expected[name])
        out0 = reader.read(h0)
        writer.write(0, {k: np.zeros_like(v) for k, v in arrays.items()})  # slot reused after its credit returns
        assert out0["obs"].any(), "the learner's copy must not change when the slot is rewritten"
    finally:
        writer.close()
        reader.close()
        remove_pools(token)
    assert not pool_path(token, "actor0").exists()


def test_shared_memory_reader_rejects_foreign_or_out_of_range_slots():
    token = "testforeign"
    writer = SlotWriter(pool_path(token, "actor0"), slots=1)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    try:
        header = writer.write(0, {"x": np.ones(10, np.float32)})
        with pytest.raises(WireError, match="not one of this run"):
            reader.read({**header, "shm": "/etc/passwd"})
        with pytest.raises(WireError, match="beyond end"):
            reader.read({**header, "slot": 5})
        with pytest.raises(WireError, match="slot"):
            reader.read({**header, "slot": "0"})
        with pytest.raises(WireError, match="need"):
            reader.read({**header, "fields": [["x", "<f4", [10_000]]]})
    finally:
        writer.close()
        reader.close()
        remove_pools(token)


def test_slot_file_never_shrinks_when_the_layout_changes():
    token = "testshrink"
    path = pool_path(token, "actor0")
    writer = SlotWriter(path, slots=2)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    try:
        writer.write(1, {"x": np.ones(1000, np.float32)})
        size = path.stat().st_size
        header = writer.write(1, {"y": np.full(10, 7, np.int64)})
        assert path.stat().st_size == size  # a reader mapping the old size must not fault
        np.testing.assert_array_equal(reader.read(header)["y"], np.full(10, 7))
    finally:
        writer.close()
        reader.close()
        remove_pools(token)


def test_reader_remaps_and_closes_while_a_batch_still_views_its_slot():
    """The learner reads slots without a copy; a slot file that grew, or the run's stop, must not fail
    on views a batch still holds (closing a mapping under them raises BufferError): it goes when they do."""
    token = "testviews"
    writer = SlotWriter(pool_path(token, "actor0"), slots=1)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    try:
        small = reader.read(writer.write(0, {"x": np.arange(10, dtype=np.float32)}), copy=False)["x"]
        big = reader.read(writer.write(0, {"x": np.full(100_000, 3, np.float32)}), copy=False)["x"]
        assert (big == 3).all() and small.shape == (10,)
        reader.close()
        assert (big == 3).all()
    finally:
        writer.close()
        reader.close()
        remove_pools(token)
