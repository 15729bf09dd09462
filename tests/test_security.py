"""The TCP data plane: CURVE encryption with the run's keys, and peers without them refused."""

from __future__ import annotations

import multiprocessing
import os
import socket as pysocket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from tianji.config import SupervisionConfig
from tianji.runtime.driver.control import ControlChannel
from tianji.runtime.roles.loops import bind_learner, learner_loop, run_role
from tianji.runtime.shared.checkpoint import FileStore
from tianji.runtime.shared.context import RunContext
from tianji.runtime.transport.security import CurveKeys, Gatekeeper, join
from tianji.runtime.transport.sockets import Endpoints, bound_endpoint, socket
from tianji.runtime.transport.wire import decode, encode, pack_header, unpack_header


def free_tcp() -> str:
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def tcp_learner(run, endpoints, token):
    def loop(ctx, events, driver):
        learner_loop(run, token, 0, bind_learner(ctx, endpoints), FileStore(run.checkpoint_dir), events, driver)

    run_role("learner", run, 1, endpoints, loop, driver_pid=os.getppid())


def fragment_frames(cfg, slot):
    T, k = cfg.topology.fragment_length, cfg.topology.envs_per_actor
    arrays = {
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
    return encode(
        {"kind": "fragment", "slot": slot, "actor": 0, "seq": slot, "version": 0, "env_steps": T * k, "epoch": 0},
        arrays,
    )


@pytest.fixture
def secured_learner(tiny_config, tmp_path):
    keys = CurveKeys.new()
    endpoints = Endpoints(free_tcp(), free_tcp(), free_tcp(), free_tcp(), keys)
    cfg = tiny_config().model_copy(update={"supervision": SupervisionConfig(driver_timeout_s=600)})
    run = RunContext(cfg, tmp_path / "run", t0=0.0, resumed=False)
    ctx = zmq.Context()
    events = socket(ctx, zmq.PULL, endpoints.events, bind=True, keys=keys)
    control = socket(ctx, zmq.PUB, endpoints.control, bind=True, keys=keys)
    process = multiprocessing.get_context("spawn").Process(target=tcp_learner, args=(run, endpoints, "sec"))
    process.start()
    yield cfg, endpoints, ctx, events
    for _ in range(50):
        control.send(pack_header({"kind": "stop"}))
        process.join(0.1)
        if not process.is_alive():
            break
    if process.is_alive():
        process.kill()
    ctx.destroy(linger=0)


def intruder(ctx, endpoint, server_public: str | None):
    """A DEALER that knows the learner's public key (or nothing at all), but not the run's client key."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_public is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public.encode(), public, secret
    sock.connect(endpoint)
    return sock


def test_peers_without_the_run_key_are_refused_and_nothing_they_send_is_trained(secured_learner):
    cfg, endpoints, ctx, events = secured_learner
    intruders = [
        intruder(ctx, endpoints.fragments, endpoints.keys.server_public),
        intruder(ctx, endpoints.fragments, None),
    ]
    for sock in intruders:  # well-formed messages: hello, then fragments for every slot
        sock.send(pack_header({"kind": "hello", "actor": 0, "slots": 2}))
        for slot in range(2):
            sock.send_multipart(fragment_frames(cfg, slot))
    totals = {"refused_peers": 0, "updates": 0, "fragments_consumed": 0}
    start = time.time()  # listen 5 s, longer (up to 30 s) on a loaded machine until a refusal is reported
    while time.time() < start + 5 or (totals["refused_peers"] < 1 and time.time() < start + 30):
        if events.poll(200):
            event = unpack_header(events.recv_multipart()[0])
            if event["kind"] == "learner":
                totals = {
                    k: max(totals[k], event.get(k, 0)) if k == "refused_peers" else totals[k] + event.get(k, 0)
                    for k in totals
                }
    assert not any(sock.poll(0) for sock in intruders), "an intruder got an answer"
    assert totals["refused_peers"] >= 1 and totals["updates"] == 0 and totals["fragments_consumed"] == 0

    # the run's own client gets its weights and its fragments are trained on
    member = ctx.socket(zmq.DEALER)
    join(member, endpoints.keys)
    member.connect(endpoints.fragments)
    member.send(pack_header({"kind": "hello", "actor": 0, "slots": 2}))
    assert member.poll(20_000)
    header, weights = decode(member.recv_multipart())
    assert header["kind"] == "weights" and "pi.0.weight" in weights
    credit = None
    while credit is None or credit["kind"] != "credit":
        assert member.poll(20_000)
        credit = unpack_header(member.recv_multipart()[0])
    member.send_multipart(fragment_frames(cfg, credit["slot"]))
    deadline, updates = time.time() + 20, 0
    while updates == 0 and time.time() < deadline:
        if events.poll(200):
            updates += unpack_header(events.recv_multipart()[0]).get("updates", 0)
    assert updates >= 1


def test_tcp_sockets_refuse_to_run_without_keys():
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="TCP sockets need the run's CURVE keys"):
            socket(ctx, zmq.PULL, free_tcp(), bind=True)
    finally:
        ctx.destroy(linger=0)


def listening_tcp(pids: set[int]) -> list[str]:
    """Every TCP socket in LISTEN state that one of `pids` holds, as 'address:port' (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # ended meanwhile
            continue
        inodes |= {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                raw = bytes.fromhex(address)
                words = b"".join(
                    raw[i : i + 4][::-1] for i in range(0, len(raw), 4)
                )  # each 32-bit word is little-endian
                host = pysocket.inet_ntop(pysocket.AF_INET if width == 8 else pysocket.AF_INET6, words)
                found.append(f"{host}:{int(port, 16)}")
    return found


def family(pid: int) -> set[int]:
    """`pid` and every process below it."""
    below = {pid}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        below |= family(int(child))
    return below


def test_a_local_run_listens_on_loopback_or_ipc_only(tmp_path):
    """Driver, learners (a group of two, with its torch.distributed store and gloo links), actors and the
    evaluator: every TCP socket any of them listens on is bound to 127.0.0.1; the rest is IPC."""
    run_dir = tmp_path / "run"
    settings = [
        "stop.target_return=null",
        "stop.max_wall_time_s=60",
        "topology.learners=2",
        "topology.actors=2",
        "eval.interval_s=1",
        "logging.console=false",
    ]
    command = [sys.executable, "-m", "tianji", "train", "cartpole-ppo", "--run-dir", str(run_dir)]
    process = subprocess.Popen([*command, *[a for s in settings for a in ("--set", s)]], stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (run_dir / "metrics.csv").exists():
            time.sleep(0.2)
        time.sleep(2.0)  # the group's store and links are up once training has begun
        processes = family(process.pid)
        listening = listening_tcp(processes)
    finally:
        process.terminate()
        process.wait(60)
    assert len(processes) >= 6, "driver, two learners, two actors and the evaluator"
    assert listening, "the learner group listens (its store and links): this test must see it"
    assert all(a.startswith(("127.0.0.1:", "::ffff:127.0.0.1:")) for a in listening), listening


def keyless(ctx, kind: int, endpoint: str, server_public: str | None):
    """A client of `kind` that knows at most the listener's public key, not the run's client key."""
    sock = intruder(ctx, endpoint, server_public) if kind == zmq.DEALER else ctx.socket(kind)
    if kind != zmq.DEALER:
        sock.setsockopt(zmq.LINGER, 0)
        if server_public is not None:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public.encode(), public, secret
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
    return sock


@pytest.mark.parametrize(
    "port", ["learner weights (PUB)", "driver events (PULL)", "driver control (PUB, heartbeat thread)"]
)
def test_every_tcp_port_of_a_ray_run_refuses_and_counts_peers_without_the_run_key(port):
    """The learner's fragments port has its own test above (nothing an intruder sends is trained). The
    others, built as the Ray launcher builds them: a keyless peer is refused in the handshake and
    counted, hears nothing and is heard by nobody; the run's own client still is."""
    keys = CurveKeys.new()
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    control = None
    try:
        if port.startswith("driver control"):
            control = ControlChannel(ctx, "tcp://127.0.0.1:*", keys)
            endpoint, client_kind = control.endpoint, zmq.SUB
            publish = lambda: control.send(b"order")  # noqa: E731  # the heartbeat goes out as well
        else:
            server_kind, client_kind = (zmq.PUB, zmq.SUB) if "PUB" in port else (zmq.PULL, zmq.PUSH)
            server = socket(ctx, server_kind, "tcp://127.0.0.1:*", bind=True, keys=keys)
            endpoint = bound_endpoint(server)
            publish = (lambda: server.send(b"weights")) if server_kind == zmq.PUB else (lambda: None)
        intruders = [keyless(ctx, client_kind, endpoint, keys.server_public), keyless(ctx, client_kind, endpoint, None)]
        member = ctx.socket(client_kind)
        join(member, keys)
        if client_kind == zmq.SUB:
            member.setsockopt(zmq.SUBSCRIBE, b"")
        member.connect(endpoint)
        deadline = time.time() + 20
        heard = False
        while time.time() < deadline and not (heard and gate.refused >= 1):
            publish()
            if client_kind == zmq.PUSH:
                for sock in [*intruders, member]:
                    sock.send(b"from intruder" if sock is not member else b"from member", zmq.NOBLOCK)
                while server.poll(100):
                    message = server.recv()
                    assert message == b"from member", "a keyless peer's message reached the listener"
                    heard = True
            else:
                heard |= bool(member.poll(100))
        assert heard, "the run's own client must get through"
        assert gate.refused >= 1, "the keyless peer with the listener's public key is refused and counted"
        if client_kind == zmq.SUB:
            assert not any(sock.poll(500) for sock in intruders), "a keyless peer heard the run"
    finally:
        if control is not None:
            control.close()
        gate.stop()
        ctx.destroy(linger=0)
