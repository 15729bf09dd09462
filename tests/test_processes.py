"""The learner process over real sockets: hello, fragments via shared memory, malformed input, stop."""

from __future__ import annotations

import multiprocessing
import secrets
import time

import numpy as np
import zmq

from tianji.config import BalanceConfig
from tianji.runtime.local import Endpoints, learner_main
from tianji.runtime.run import RunContext
from tianji.shm import SlotWriter, pool_path, remove_pools
from tianji.wire import decode, pack_header, unpack_header


def bound(ctx, kind, endpoint):
    sock = ctx.socket(kind)
    sock.bind(endpoint)
    return sock


def start(target, *args):
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


def recv_until(sock, predicate, timeout_ms=20_000):
    while sock.poll(timeout_ms):
        frames = sock.recv_multipart()
        if predicate(frames):
            return frames
    raise AssertionError("expected message did not arrive")


def test_learner_survives_malformed_messages_and_keeps_training(tiny_config, tmp_path):
    cfg = tiny_config().model_copy(update={"balance": BalanceConfig(max_policy_lag=1)})
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    token = secrets.token_hex(4)
    endpoints = Endpoints.ipc(token)
    ctx = zmq.Context()
    events, control = bound(ctx, zmq.PULL, endpoints.events), bound(ctx, zmq.PUB, endpoints.control)
    process = start(learner_main, run, endpoints, token)
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

        # after two updates, a fragment from version 0 is over max_policy_lag=1: dropped, credit returned
        header = writer.write(1, arrays)
        header.update(kind="fragment", actor=0, seq=2, version=1, env_steps=T * k)
        link.send(pack_header(header))
        assert decode(recv_until(link, lambda f: True))[0]["slot"] == 1
        time.sleep(0.5)
        header.update(seq=3, version=0)
        link.send(pack_header(header))
        assert decode(recv_until(link, lambda f: True))[0]["slot"] == 1

        seen = {"bad_messages": 0, "updates": 0, "dropped": 0}
        while not (seen["bad_messages"] >= 3 and seen["updates"] >= 2 and seen["dropped"] >= 1):
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


def test_actor_never_exceeds_its_credits(tiny_config, tmp_path):
    """A fake learner that withholds credits gets exactly max_inflight fragments, then one per credit."""
    from tianji.runtime.local import actor_main
    from tianji.wire import encode

    cfg = tiny_config()
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    token = secrets.token_hex(4)
    endpoints = Endpoints.ipc(token)
    ctx = zmq.Context()
    router = bound(ctx, zmq.ROUTER, endpoints.fragments)
    bound(ctx, zmq.PUB, endpoints.weights)
    bound(ctx, zmq.PULL, endpoints.events)
    control = bound(ctx, zmq.PUB, endpoints.control)
    process = start(actor_main, run, endpoints, token, 0)
    try:
        from tianji.runtime.build import build_learner

        weights = build_learner(cfg).weights()
        identity, hello = router.recv_multipart()
        assert unpack_header(hello)["kind"] == "hello"
        router.send_multipart([identity, *encode({"kind": "weights", "version": 0}, weights)])

        def notices_within(seconds):
            got = []
            deadline = time.time() + seconds
            while time.time() < deadline:
                if router.poll(50):
                    got.append(unpack_header(router.recv_multipart()[1]))
            return got

        first = notices_within(3.0)
        assert len(first) == cfg.balance.max_inflight
        assert sorted(h["slot"] for h in first) == list(range(cfg.balance.max_inflight))
        assert [h["seq"] for h in first] == list(range(cfg.balance.max_inflight))
        # each actor process has its own slot file, so a restarted actor never rewrites slots its
        # dead predecessor announced
        assert first[0]["shm"].endswith(f"-actor0-pid{process.pid}")
        router.send_multipart([identity, pack_header({"kind": "credit", "slot": first[0]["slot"]})])
        more = notices_within(2.0)
        assert len(more) == 1 and more[0]["slot"] == first[0]["slot"]
    finally:
        for _ in range(20):
            control.send(pack_header({"kind": "stop"}))
            process.join(0.1)
            if not process.is_alive():
                break
        if process.is_alive():
            process.kill()
        remove_pools(token)
        ctx.destroy(linger=0)
        for path in endpoints.ipc_paths():
            path.unlink(missing_ok=True)
    assert process.exitcode == 0
