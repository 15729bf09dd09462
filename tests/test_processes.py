"""Role processes over real sockets, each against a fake peer: hello, credits, fragments via shared
memory, malformed input, lag-aware credits, learner restarts (epochs), stop."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time

import numpy as np
import pytest
import zmq

from tianji.config import BalanceConfig, SupervisionConfig
from tianji.runtime.roles.links import LearnerLink
from tianji.runtime.roles.loops import actor_main, learner_main
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.protocol import Hello
from tianji.runtime.transport.shm import SlotWriter, pool_path, remove_pools
from tianji.runtime.transport.sockets import Endpoints
from tianji.runtime.transport.wire import decode, encode, pack_header, unpack_header


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


def kind_is(kind):
    return lambda frames: unpack_header(frames[0])["kind"] == kind


def quiet_driver_config(cfg, **balance):
    """No driver sends heartbeats in these tests: a long driver timeout keeps the role running."""
    return cfg.model_copy(
        update={"supervision": SupervisionConfig(driver_timeout_s=600), "balance": BalanceConfig(**balance)}
    )


@pytest.fixture
def wiring(tmp_path):
    token = f"{secrets.token_hex(4)}p{os.getpid()}"
    endpoints = Endpoints.ipc(token)
    ctx = zmq.Context()
    yield token, endpoints, ctx
    remove_pools(token)
    ctx.destroy(linger=0)
    for path in endpoints.ipc_paths():
        path.unlink(missing_ok=True)


def stop_role(process, control):
    for _ in range(50):
        control.send(pack_header({"kind": "stop"}))
        process.join(0.1)
        if not process.is_alive():
            return
    process.kill()


def ppo_fragment(cfg):
    T, k = cfg.topology.fragment_length, cfg.topology.envs_per_actor
    return {
        "obs": np.zeros((T, k, 4), np.float32),
        "action": np.zeros((T, k), np.int64),
        "logp": np.full((T, k), -0.69, np.float32),
        "value": np.zeros((T, k), np.float32),
        "reward": np.ones((T, k), np.float32),
        "terminated": np.zeros((T, k), bool),
        "done": np.zeros((T, k), bool),
        "valid": np.ones((T, k), bool),
        "bootstrap_value": np.zeros(k, np.float32),
        "last_obs": np.zeros((k, 4), np.float32),  # the learner evaluates it (algo.stale_correction)
    }


def test_learner_survives_malformed_messages_and_keeps_training(tiny_config, tmp_path, wiring):
    token, endpoints, ctx = wiring
    cfg = quiet_driver_config(tiny_config(), max_policy_lag=1)
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    events, control = bound(ctx, zmq.PULL, endpoints.events), bound(ctx, zmq.PUB, endpoints.control)
    process = start(learner_main, run, endpoints, token, os.getpid())
    link = ctx.socket(zmq.DEALER)
    link.connect(endpoints.fragments)
    writer = SlotWriter(pool_path(token, "actor0"), slots=2)

    def next_credit():
        return decode(recv_until(link, kind_is("credit")))[0]

    def send_fragment(slot, seq, version):
        header = writer.write(slot, ppo_fragment(cfg))
        header.update(kind="fragment", actor=0, seq=seq, version=version, env_steps=64, epoch=0)
        link.send(pack_header(header))

    try:
        link.send(pack_header({"kind": "hello", "actor": 0, "slots": 2}))
        header, weights = decode(recv_until(link, kind_is("weights")))
        assert header["version"] == 0 and header["epoch"] == 0 and "pi.0.weight" in weights
        # the learner owns the slots and grants both: one in flight is worth one version, within the bound 1
        assert {next_credit()["slot"], next_credit()["slot"]} == {0, 1}

        # malformed: garbage bytes, unknown kind, a path outside the run, a slot that was not granted
        link.send(b"\x00\xffnot msgpack")
        link.send(pack_header({"kind": "surprise"}))
        link.send(
            pack_header(
                {
                    "kind": "fragment",
                    "shm": "/etc/passwd",
                    "slot": 0,
                    "slot_bytes": 64,
                    "fields": [],
                    "actor": 0,
                    "seq": 0,
                    "version": 0,
                    "env_steps": 1,
                    "epoch": 0,
                }
            )
        )
        assert next_credit()["slot"] == 0  # a rejected notice still gives its slot back
        link.send(
            pack_header(
                {
                    "kind": "fragment",
                    "shm": str(writer.path),
                    "slot": 7,
                    "slot_bytes": 64,
                    "fields": [],
                    "actor": 0,
                    "seq": 0,
                    "version": 0,
                    "env_steps": 1,
                    "epoch": 0,
                }
            )
        )

        # well-formed fragments train the learner; the slots come back once none in flight could be
        # overtaken past the bound (slot 0, granted at version 0, would be 2 behind after a new one)
        send_fragment(slot=1, seq=1, version=0)
        send_fragment(slot=0, seq=2, version=0)
        assert {next_credit()["slot"], next_credit()["slot"]} == {0, 1}
        time.sleep(0.5)
        # after two updates, a fragment from version 0 is over max_policy_lag=1: dropped, its slot returned
        send_fragment(slot=1, seq=3, version=0)
        assert next_credit()["slot"] == 1

        seen = {"bad_messages": 0, "updates": 0, "dropped": 0}
        while not (seen["bad_messages"] >= 4 and seen["updates"] >= 2 and seen["dropped"] >= 1):
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
        assert list((run.checkpoint_dir / "staging").glob("learner-r0-v*.pt"))  # staged, for the driver to make a set
    finally:
        if process.is_alive():
            process.kill()
        writer.close()


class WeightsSeen:
    version = -1

    def set_weights(self, version, weights, force=False):
        self.version = version


def test_an_actor_measures_its_link_from_probes_the_learner_echoes(tiny_config, tmp_path, wiring):
    """What an actor on another machine does before its first fragment: empty and payload probes,
    echoed by the learner at once; the weights that answer its hello meanwhile are taken as usual."""
    token, endpoints, ctx = wiring
    cfg = quiet_driver_config(tiny_config())
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    events, control = bound(ctx, zmq.PULL, endpoints.events), bound(ctx, zmq.PUB, endpoints.control)
    process = start(learner_main, run, endpoints, token, os.getpid())
    try:
        learner = LearnerLink(ctx, endpoints, "actor0", Hello(actor=0, slots=2))
        taker = WeightsSeen()
        # 4 MiB probes, the shortest of 5: the transfer stands out of the noise of a busy machine
        costs = learner.measure(taker, payload_bytes=4 << 20, repeats=5, timeout_s=20)
        assert costs is not None and costs["link_probe_bytes"] == 4 << 20
        assert 0 < costs["link_latency_s"] < 1 and costs["link_bytes_per_s"] > 1e6
        assert taker.version == 0 and learner.has_weights  # the hello's reply, taken during the probes
        learner.link.send(pack_header({"kind": "probe"}))  # malformed: no sequence number
        seen = 0
        while not seen:
            assert events.poll(20_000), "learner events stopped"
            seen = unpack_header(events.recv()).get("bad_messages", 0)
        assert process.is_alive()
    finally:
        stop_role(process, control)


def test_learner_ignores_notices_of_an_earlier_incarnation(tiny_config, tmp_path, wiring):
    token, endpoints, ctx = wiring
    cfg = quiet_driver_config(tiny_config())
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    events, control = bound(ctx, zmq.PULL, endpoints.events), bound(ctx, zmq.PUB, endpoints.control)
    process = start(learner_main, run, endpoints, token, os.getpid(), 3)  # third restart: epoch 3
    link = ctx.socket(zmq.DEALER)
    link.connect(endpoints.fragments)
    writer = SlotWriter(pool_path(token, "actor0"), slots=2)
    try:
        link.send(pack_header({"kind": "hello", "actor": 0, "slots": 2}))
        assert decode(recv_until(link, kind_is("weights")))[0]["epoch"] == 3
        credit = decode(recv_until(link, kind_is("credit")))[0]
        assert credit["epoch"] == 3
        header = writer.write(credit["slot"], ppo_fragment(cfg))
        header.update(kind="fragment", actor=0, seq=0, version=0, env_steps=64, epoch=2)
        link.send(pack_header(header))
        stale = 0
        deadline = time.time() + 20
        while stale < 1 and time.time() < deadline:
            if events.poll(200):
                event = unpack_header(events.recv())
                stale += event.get("stale_notices", 0)
                assert event.get("updates", 0) == 0
        assert stale == 1
    finally:
        stop_role(process, control)
        writer.close()


class FakeLearner:
    """The learner's side of an actor's links: answers hello, grants credits, publishes weights."""

    def __init__(self, ctx, endpoints, cfg):
        from tianji.runtime.roles.build import build_learner

        self.router = bound(ctx, zmq.ROUTER, endpoints.fragments)
        self.publisher = bound(ctx, zmq.PUB, endpoints.weights)
        self.weights = build_learner(cfg).weights()
        self.identity = None

    def answer_hello(self, epoch=0, version=0):
        identity, hello = self.router.recv_multipart()
        assert unpack_header(hello) == {"kind": "hello", "actor": 0, "slots": 2}
        self.identity = identity
        self.router.send_multipart(
            [identity, *encode({"kind": "weights", "version": version, "epoch": epoch}, self.weights)]
        )

    def reply_weights(self, epoch, version):
        self.router.send_multipart(
            [self.identity, *encode({"kind": "weights", "version": version, "epoch": epoch}, self.weights)]
        )

    def credit(self, slot, min_version=0, epoch=0):
        self.router.send_multipart(
            [self.identity, pack_header({"kind": "credit", "slot": slot, "min_version": min_version, "epoch": epoch})]
        )

    def publish(self, version, epoch=0):
        self.publisher.send_multipart(encode({"kind": "weights", "version": version, "epoch": epoch}, self.weights))

    def notices_within(self, seconds):
        got = []
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.router.poll(50):
                header = unpack_header(self.router.recv_multipart()[1])
                if header["kind"] == "fragment":
                    got.append(header)
        return got


def test_actor_fills_only_granted_slots_with_weights_new_enough(tiny_config, tmp_path, wiring):
    """No credit, no fragment; a credit asking for newer weights waits for them; a restarted learner
    (new epoch) owns every slot again, so credits of the old one are void."""
    token, endpoints, ctx = wiring
    cfg = quiet_driver_config(tiny_config())
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    learner = FakeLearner(ctx, endpoints, cfg)
    bound(ctx, zmq.PULL, endpoints.events)
    control = bound(ctx, zmq.PUB, endpoints.control)
    process = start(actor_main, run, endpoints, token, os.getpid(), 0)
    try:
        learner.answer_hello()
        assert learner.notices_within(1.0) == []  # the learner holds every slot until it grants one

        learner.credit(0)
        learner.credit(1)
        first = learner.notices_within(3.0)
        assert sorted(h["slot"] for h in first) == [0, 1] and [h["seq"] for h in first] == [0, 1]
        assert all(h["epoch"] == 0 and h["version"] == 0 for h in first)
        # each actor process has its own slot file, so a restarted actor never rewrites slots its
        # dead predecessor announced
        assert first[0]["shm"].endswith(f"-actor0-pid{process.pid}")

        learner.credit(0, min_version=5)  # lag-aware: start only with weights of version 5 or newer
        assert learner.notices_within(1.0) == []
        learner.publish(version=4)
        assert learner.notices_within(1.0) == []
        learner.publish(version=5)
        [notice] = learner.notices_within(2.0)
        assert notice["slot"] == 0 and notice["version"] == 5

        learner.reply_weights(epoch=1, version=2)  # a restarted learner, from an older checkpoint
        learner.credit(1, epoch=0)  # void: from the learner before the restart
        assert learner.notices_within(1.0) == []
        learner.credit(1, epoch=1)
        [notice] = learner.notices_within(2.0)
        assert notice["slot"] == 1 and notice["epoch"] == 1 and notice["version"] == 2
    finally:
        stop_role(process, control)
    assert process.exitcode == 0


def test_role_exits_when_the_driver_falls_silent(tiny_config, tmp_path, wiring):
    token, endpoints, ctx = wiring
    cfg = tiny_config().model_copy(update={"supervision": SupervisionConfig(driver_timeout_s=1.0)})
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    learner = FakeLearner(ctx, endpoints, cfg)
    bound(ctx, zmq.PULL, endpoints.events)
    control = bound(ctx, zmq.PUB, endpoints.control)
    process = start(actor_main, run, endpoints, token, os.getpid(), 0)
    try:
        learner.answer_hello()
        for _ in range(10):  # heartbeats keep it alive
            control.send(pack_header({"kind": "heartbeat"}))
            time.sleep(0.2)
        assert process.is_alive()
        process.join(5)  # silence: it exits within the timeout
        assert not process.is_alive() and process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


def test_learner_trains_from_the_slot_and_frees_it_only_after_the_update(tiny_config, tmp_path, wiring):
    """On-policy fragments are not copied out of shared memory: the slot stays the learner's until
    the update that trains on it returns, so its actor cannot overwrite it meanwhile."""
    token, endpoints, ctx = wiring
    base = tiny_config()
    cfg = quiet_driver_config(
        base.model_copy(update={"algo": base.algo.model_copy(update={"batch_fragments": 2})}), max_policy_lag=100
    )
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    events, control = bound(ctx, zmq.PULL, endpoints.events), bound(ctx, zmq.PUB, endpoints.control)
    process = start(learner_main, run, endpoints, token, os.getpid())
    link = ctx.socket(zmq.DEALER)
    link.connect(endpoints.fragments)
    writer = SlotWriter(pool_path(token, "actor0"), slots=2)

    def send_fragment(slot, seq):
        header = writer.write(slot, ppo_fragment(cfg))
        header.update(kind="fragment", actor=0, seq=seq, version=0, env_steps=64, epoch=0)
        link.send(pack_header(header))

    try:
        link.send(pack_header({"kind": "hello", "actor": 0, "slots": 2}))
        recv_until(link, kind_is("weights"))
        granted = {decode(recv_until(link, kind_is("credit")))[0]["slot"] for _ in range(2)}
        assert granted == {0, 1}
        send_fragment(slot=1, seq=1)  # half a batch: the learner keeps training data in slot 1
        deadline = time.time() + 1.5
        while time.time() < deadline:
            if link.poll(100):
                assert not kind_is("credit")(link.recv_multipart()), "slot 1 came back before it was trained on"
        send_fragment(slot=0, seq=2)  # the batch is full: one update, then both slots come back
        granted = {decode(recv_until(link, kind_is("credit")))[0]["slot"] for _ in range(2)}
        assert granted == {0, 1}
        updates = 0
        while updates < 1:
            assert events.poll(20_000)
            updates += unpack_header(events.recv()).get("updates", 0)
    finally:
        stop_role(process, control)
        writer.close()
