"""Data-plane throughput: shared-memory slots and the ZeroMQ wire format, next to a plain memcpy,
and over TCP loopback next to raw ZeroMQ TCP, with and without CURVE encryption.

    python benchmarks/transport.py [--seconds 1.5] [--repeats 3]

Prints GB/s for a 1 MiB payload and for an Atari fragment (32 steps x 32 envs x 4x84x84 uint8, 29 MB),
each measured in this run beside memcpy of the same size, with the ratio to memcpy.
Same-machine paths: the producer writes each step's rows straight into a shared-memory slot, as an
actor does, and sends only the header over ZeroMQ ipc; the consumer either takes the arrays as views
of the slot, reads every byte of them (as the learner's first layer does) and returns the credit
(what the learner does: it trains from the slot) or copies them out once first (what it does without
back-pressure, when fragments may wait in a backlog). The wire paths send the
bytes themselves (across machines: TCP, CURVE-encrypted in TianJi); "raw zmq tcp" sends one plain
frame per payload with no header, no checks and no encryption: the yardstick for TianJi's TCP rows.
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from tianji.runtime.transport.shm import SlotReader, SlotWriter, pool_path, remove_pools
from tianji.runtime.transport.wire import decode, encode, pack_header, unpack_header

PAYLOADS = {  # [steps, ...]: rows are written one step at a time
    "1 MiB": {"data": np.ones((16, 1 << 16), np.uint8)},
    "atari fragment 32x32x4x84x84": {"obs": np.ones((32, 32, 4, 84, 84), np.uint8)},  # 29 MB
}


def nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays.values())


def touched(arrays) -> int:
    """Read every byte of `arrays` (as a learner's first layer does with the views it trains from) and
    return how many: a consumer is credited only with bytes it has read."""
    for array in arrays.values():
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        whole = len(flat) // 8 * 8
        np.add.reduce(flat[:whole].view(np.uint64))  # 8 bytes per add: bound by memory, not arithmetic
        np.add.reduce(flat[whole:], dtype=np.uint64)
    return nbytes(arrays)


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


PATHS = {  # label -> (transport, TianJi wire format, CURVE)
    "shm, trained in the slot": ("shm-views", True, False),  # what the learner does (back-pressure on)
    "shm, copied out": ("shm", True, False),
    "zmq ipc, bytes on the wire": ("ipc", True, False),
    "raw zmq tcp (yardstick)": ("tcp", False, False),
    "tianji tcp, CURVE off": ("tcp", True, False),
    "tianji tcp, CURVE on": ("tcp", True, True),
}


def _secure(sock: zmq.Socket, keys: dict | None, server: bool) -> None:
    if keys is not None:
        from tianji.runtime.transport.security import CurveKeys, join, serve

        (serve if server else join)(sock, CurveKeys(**keys))


def _producer(endpoint: str, token: str, name: str, seconds: float, path: str, slots: int, keys: dict | None) -> None:
    transport, tianji_format, _ = PATHS[path]
    arrays = PAYLOADS[name]
    raw = next(iter(arrays.values())).reshape(-1)
    ctx = zmq.Context()
    link = ctx.socket(zmq.DEALER)
    _secure(link, keys, server=False)
    link.connect(endpoint)
    writer = SlotWriter(pool_path(token, "bench"), slots) if transport.startswith("shm") else None
    free = list(range(slots))
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not free:
            free.append(unpack_header(link.recv())["slot"])
        slot = free.pop()
        if writer is not None:
            views = writer.views(slot)
            if views is None:  # the first fragment fixes the slot's layout
                header = writer.write(slot, arrays)
            else:  # then rows go straight into the slot, one step at a time, as an actor writes them
                for name, array in arrays.items():
                    for t in range(array.shape[0]):
                        views[name][t] = array[t]
                header = writer.header(slot)
            link.send(pack_header({"kind": "fragment", **header}))
        elif tianji_format:
            link.send_multipart(encode({"kind": "fragment", "slot": slot}, arrays), copy=False)
        else:
            link.send_multipart([slot.to_bytes(2, "little"), raw], copy=False)
    link.send(pack_header({"kind": "done"}))
    ctx.destroy(linger=30_000)  # a short linger could drop "done" behind queued 29 MB messages


def _endpoint(transport: str, token: str) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    return f"ipc://{tempfile.gettempdir()}/tianji-bench-{token}"


def transfer_gbps(name: str, seconds: float, path: str, slots: int = 4) -> float:
    transport, tianji_format, curve = PATHS[path]
    token = secrets.token_hex(4)
    ctx = zmq.Context()
    keys = gate = None
    if curve:
        from tianji.runtime.transport.security import CurveKeys, Gatekeeper

        keys = CurveKeys.new()
        gate = Gatekeeper(ctx, keys)
    router = ctx.socket(zmq.ROUTER)
    _secure(router, keys and keys.as_dict(), server=True)
    router.bind(_endpoint(transport, token))
    endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    reader = SlotReader(f"tianji-{token}-")
    proc = multiprocessing.get_context("spawn").Process(  # not forked from a process holding a ZeroMQ context
        target=_producer, args=(endpoint, token, name, seconds, path, slots, keys and keys.as_dict())
    )
    proc.start()
    try:
        received, start = 0, None
        while True:
            if not router.poll(20_000):
                raise TimeoutError(f"{path}: no message from the producer for 20 s (exit code {proc.exitcode})")
            identity, *frames = router.recv_multipart(copy=False)
            if tianji_format or len(frames) == 1:
                header = unpack_header(frames[0])
                if header["kind"] == "done":
                    break
                slot = header["slot"]
            else:
                slot = int.from_bytes(frames[0].bytes, "little")
            if start is None:
                start = time.perf_counter()  # from the first arrival: excludes process start and handshakes
            elif transport == "shm":
                received += nbytes(reader.read(header))
            elif transport == "shm-views":  # the learner trains from the slot (reads it) and frees it afterwards
                received += touched(reader.read(header, copy=False))
            elif tianji_format:
                received += nbytes({k: v.copy() for k, v in decode(frames)[1].items()})
            else:
                received += np.frombuffer(frames[1].buffer, np.uint8).copy().nbytes
            router.send_multipart([identity, pack_header({"kind": "credit", "slot": slot})])
        elapsed = time.perf_counter() - start
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        reader.close()
        remove_pools(token)
        if gate is not None:
            gate.stop()
        ctx.destroy(linger=0)
        if endpoint.startswith("ipc://"):
            Path(endpoint[len("ipc://") :]).unlink(missing_ok=True)
    return received / elapsed / 1e9


def measure(name: str, seconds: float, path: str, attempts: int = 3) -> float:
    """transfer_gbps, again when a transfer stalls (seen now and then with 29 MB messages over TCP
    loopback on the 2-core machine: the producer finishes, its last messages never arrive)."""
    for attempt in range(1, attempts + 1):
        try:
            return transfer_gbps(name, seconds, path)
        except TimeoutError as exc:
            print(f"  (attempt {attempt}: {exc})", file=sys.stderr, flush=True)
    raise TimeoutError(f"{path}: {attempts} stalled transfers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell (median reported)")
    args = parser.parse_args()
    print(f"{'payload':<30} {'path':<28} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6} {'/ raw tcp':>9}")
    for name, arrays in PAYLOADS.items():
        rates: dict[str, list[float]] = {path: [] for path in PATHS}
        copies: list[float] = []
        for _ in range(args.repeats):  # paths take turns, so drift hits every row alike
            for path in PATHS:
                rates[path].append(measure(name, args.seconds, path))
            copies.append(memcpy_gbps(arrays, args.seconds / 2))
        base = statistics.median(copies)
        raw = statistics.median(rates["raw zmq tcp (yardstick)"])
        for path, values in rates.items():
            rate = statistics.median(values)
            versus_raw = f"{rate / raw:9.2f}" if PATHS[path][0] == "tcp" else ""
            print(f"{name:<30} {path:<28} {rate:7.2f} {base:12.2f} {rate / base:6.2f} {versus_raw}")
    print(
        "GB/s counts payload bytes the consumer has read: every byte of the views of the slot it trains from, or "
        "in its own memory (one copy out of the transport)."
    )


if __name__ == "__main__":
    main()
