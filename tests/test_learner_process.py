"""The learner process over real sockets: hello, fragments via shared memory, malformed input, stop."""

from __future__ import annotations

import multiprocessing
import secrets

import numpy as np
import zmq

from tianji.runtime.local import Endpoints, learner_main
from tianji.runtime.run import RunContext
from tianji.shm import SlotWriter, pool_path, remove_pools
from tianji.wire import decode, pack_header, unpack_header


def recv_until(sock, predicate, timeout_ms=20_000):
    while sock.poll(timeout_ms):
        frames = sock.recv_multipart()
        if predicate(frames):
            return frames
    raise AssertionError("expected message did not arrive")


def test_learner_survives_malformed_messages_and_keeps_training(tiny_config, tmp_path):
    cfg = tiny_config()
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    token = secrets.token_hex(4)
    endpoints = Endpoints.ipc(token)
    ctx = zmq.Context()
    events = ctx.socket(zmq.PULL)
    events.bind(endpoints.events)
    control = ctx.socket(zmq.PUB)
    control.bind(endpoints.control)
    process = multiprocessing.get_context("fork").Process(target=learner_main, args=(run, endpoints, token))
    process.start()
    link = ctx.socket(zmq.DEALER)
    link.connect(endpoints.fragments)
    writer = SlotWriter(pool_path(token, "actor0"), slots=2)
    try:
        link.send(pack_header({"kind": "hello", "actor": 0}))
        header, weights = decode(recv_until(link, lambda f: unpack_header(f[0])["kind"] == "weights"))
        assert header["version"] == 0 and "pi.0.weight" in weights

        # malformed: garbage bytes, unknown kind, a path outside the run, a header with a bad field
        link.send(b"\x00\xffnot msgpack")
        link.send(pack_header({"kind": "surprise"}))
        link.send(pack_header({"kind": "fragment", "shm": "/etc/passwd", "slot": 0, "slot_bytes": 64,
                               "fields": [], "actor": 0, "seq": 0, "version": 0, "env_steps": 1}))
        credit = decode(recv_until(link, lambda f: True))[0]
        assert credit["kind"] == "credit" and credit["slot"] == 0  # a rejected notice still returns its credit

        # a well-formed fragment still trains the learner
        T, k = cfg.topology.fragment_length, cfg.topology.envs_per_actor
        arrays = {
            "obs": np.zeros((T, k, 4), np.float32), "action": np.zeros((T, k), np.int64),
            "logp": np.full((T, k), -0.69, np.float32), "value": np.zeros((T, k), np.float32),
            "reward": np.ones((T, k), np.float32), "terminated": np.zeros((T, k), bool),
            "done": np.zeros((T, k), bool), "valid": np.ones((T, k), bool),
            "bootstrap_value": np.zeros(k, np.float32),
        }
        header = writer.write(1, arrays)
        header.update(kind="fragment", actor=0, seq=1, version=0, env_steps=T * k)
        link.send(pack_header(header))
        assert decode(recv_until(link, lambda f: True))[0]["slot"] == 1

        seen = {"bad_messages": 0, "updates": 0}
        while not (seen["bad_messages"] >= 3 and seen["updates"] >= 1):
            assert events.poll(20_000), f"learner events stopped: {seen}"
            event = unpack_header(events.recv())
            for key in seen:
                seen[key] += event.get(key, 0)
        assert process.is_alive()

        control.send(pack_header({"kind": "stop"}))
        kinds = set()
        while "stopped" not in kinds:
            if not events.poll(500):
                control.send(pack_header({"kind": "stop"}))
                continue
            kinds.add(unpack_header(events.recv())["kind"])
        assert "checkpoint" in kinds
        process.join(10)
        assert process.exitcode == 0
        assert (run.checkpoint_dir / "learner.pt").exists()
    finally:
        if process.is_alive():
            process.kill()
        writer.close()
        remove_pools(token)
        ctx.destroy(linger=0)
        for path in endpoints.ipc_paths():
            path.unlink(missing_ok=True)
