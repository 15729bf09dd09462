"""Data-plane throughput: shared-memory slots and the ZeroMQ wire format, next to a plain memcpy.

    python benchmarks/transport.py [--seconds 2]

Prints GB/s for a 1 MiB payload and for an Atari-sized fragment (32 steps x 8 envs x 84x84x4 uint8),
each measured in this run beside memcpy of the same size, with the ratio to memcpy.
Same-machine path: the producer copies into a shared-memory slot and sends only the header over
ZeroMQ ipc; the consumer copies the arrays out and returns the credit. The wire path sends the
bytes themselves (used across machines).
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from tianji.shm import SlotReader, SlotWriter, pool_path, remove_pools
from tianji.wire import decode, encode, pack_header, unpack_header

PAYLOADS = {
    "1 MiB": {"data": np.ones(1 << 20, np.uint8)},
    "atari fragment 32x8x84x84x4": {"obs": np.ones((32, 8, 84, 84, 4), np.uint8)},
}


def nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays.values())


def memcpy_gbps(arrays, seconds: float, working_set: int = 256 << 20) -> float:
    """memcpy of the same size, cycling through buffers larger than the caches (the hardware limit)."""
    size = nbytes(arrays)
    count = max(2, working_set // size)
    buffers = [np.ones(size, np.uint8) for _ in range(count)]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.copyto(buffers[(n + 1) % count], buffers[n % count])
        n += 1
    return n * size / (time.perf_counter() - start) / 1e9


def _producer(endpoint: str, token: str, name: str, seconds: float, use_shm: bool, slots: int) -> None:
    arrays = PAYLOADS[name]
    ctx = zmq.Context()
    link = ctx.socket(zmq.DEALER)
    link.connect(endpoint)
    writer = SlotWriter(pool_path(token, "bench"), slots) if use_shm else None
    free = list(range(slots))
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not free:
            free.append(unpack_header(link.recv())["slot"])
        slot = free.pop()
        if writer is not None:
            link.send(pack_header({"kind": "fragment", **writer.write(slot, arrays)}))
        else:
            link.send_multipart(encode({"kind": "fragment", "slot": slot}, arrays), copy=False)
    link.send(pack_header({"kind": "done"}))
    ctx.destroy(linger=1000)


def transfer_gbps(name: str, seconds: float, use_shm: bool, slots: int = 4) -> float:
    token = secrets.token_hex(4)
    endpoint = f"ipc://{tempfile.gettempdir()}/tianji-bench-{token}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    reader = SlotReader(f"tianji-{token}-")
    proc = multiprocessing.get_context("fork").Process(
        target=_producer, args=(endpoint, token, name, seconds, use_shm, slots))
    proc.start()
    received, start = 0, None
    while True:
        identity, *frames = router.recv_multipart(copy=False)
        header = unpack_header(frames[0])
        if header["kind"] == "done":
            break
        if start is None:
            start = time.perf_counter()  # from the first arrival: excludes process start
            continue
        arrays = reader.read(header) if use_shm else {k: v.copy() for k, v in decode(frames)[1].items()}
        router.send_multipart([identity, pack_header({"kind": "credit", "slot": header["slot"]})])
        received += nbytes(arrays)
    elapsed = time.perf_counter() - start
    proc.join()
    reader.close()
    remove_pools(token)
    ctx.destroy(linger=0)
    Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
    return received / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell (median reported)")
    args = parser.parse_args()
    print(f"{'payload':<30} {'path':<26} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6}")
    for name, arrays in PAYLOADS.items():
        for label, use_shm in (("shared memory + ipc header", True), ("zmq ipc, bytes on the wire", False)):
            pairs = [(transfer_gbps(name, args.seconds, use_shm), memcpy_gbps(arrays, args.seconds / 2))
                     for _ in range(args.repeats)]
            rate = statistics.median(p[0] for p in pairs)
            base = statistics.median(p[1] for p in pairs)
            print(f"{name:<30} {label:<26} {rate:7.2f} {base:12.2f} {rate / base:6.2f}")
    print("GB/s counts payload bytes delivered into the consumer's own memory (one copy out of the transport).")


if __name__ == "__main__":
    main()
