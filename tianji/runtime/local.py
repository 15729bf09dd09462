"""Local launcher: a learner process and A actor processes on this machine, wired by ZeroMQ.

Who talks to whom (all in `run_local`):

    actor  --DEALER-->  learner ROUTER   fragment notices (data stays in shared memory)
    actor <--DEALER---  learner ROUTER   credits (slot returned) and first weights on hello
    actor  <--SUB-----  learner PUB      versioned weights, newest wins
    roles  --PUSH---->  driver PULL      metric deltas (heartbeats), checkpoint notices, errors
    roles  <--SUB-----  driver PUB       stop
    evaluator: hello on a DEALER and weights on a SUB like an actor; sends greedy returns as events

The driver never touches sample data.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import secrets
import signal
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq

from tianji.checkpoint import save_driver, save_learner
from tianji.metrics import Monitor
from tianji.runtime.actor import Fragment
from tianji.runtime.build import build_actor, build_evaluator, build_learner
from tianji.runtime.events import ActorReporter, LearnerReporter
from tianji.runtime.run import RunContext
from tianji.shm import SlotReader, SlotWriter, pool_path, remove_pools
from tianji.wire import WireError, decode, encode, pack_header, unpack_header

log = logging.getLogger("tianji")

EVENT_INTERVAL_S = 0.1
STOP_GRACE_S = 20.0
MAX_ROLE_RESTARTS = 10
HEARTBEAT_TIMEOUT_S = 60.0  # an actor silent this long (hung env, deadlock) is replaced


@dataclass(frozen=True)
class Endpoints:
    fragments: str
    weights: str
    events: str
    control: str

    @classmethod
    def ipc(cls, token: str) -> "Endpoints":
        base = f"ipc://{tempfile.gettempdir()}/tianji-{token}"
        return cls(f"{base}-fragments", f"{base}-weights", f"{base}-events", f"{base}-control")

    def ipc_paths(self) -> list[Path]:
        return [Path(e[len("ipc://"):]) for e in (self.fragments, self.weights, self.events, self.control)]


class RoleError(RuntimeError):
    """A role process failed in a way the driver cannot repair."""


# ---------------------------------------------------------------- shared helpers


def _init_role_process(threads: int) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; roles stop by message
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(threads)


def _socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)  # never hang on exit if the peer is gone
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def _stop_requested(control: zmq.Socket) -> bool:
    stop = False
    while control.poll(0):
        try:
            stop |= unpack_header(control.recv()).get("kind") == "stop"
        except WireError:
            pass
    return stop


def _run_role(name: str, threads: int, endpoints: Endpoints,
              loop: Callable[[zmq.Context, zmq.Socket], None]) -> None:
    """Process body shared by every role: setup, the role's loop, a crash report to the driver."""
    _init_role_process(threads)
    ctx = zmq.Context()
    events = _socket(ctx, zmq.PUSH, endpoints.events)
    try:
        loop(ctx, events)
    except Exception:
        events.send(pack_header({"kind": "error", "role": name, "message": traceback.format_exc()}))
        raise
    finally:
        ctx.destroy(linger=1000)


def _newest(sock: zmq.Socket) -> list[Any] | None:
    """Drain a SUB socket and keep the newest message (newest weights win)."""
    newest = None
    while sock.poll(0):
        newest = sock.recv_multipart(copy=False)
    return newest


def _weights_client(ctx: zmq.Context, endpoints: Endpoints) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket, zmq.Poller]:
    """The sockets of a role that takes weights: DEALER to the learner, weights SUB, control SUB."""
    link = _socket(ctx, zmq.DEALER, endpoints.fragments)
    weights = _socket(ctx, zmq.SUB, endpoints.weights)
    control = _socket(ctx, zmq.SUB, endpoints.control)
    poller = zmq.Poller()
    for sock in (link, weights, control):
        poller.register(sock, zmq.POLLIN)
    return link, weights, control, poller


def _checked(frames: list[Any] | None, role: str, counter: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Decode a message from the learner; None (logged, counted on `counter.bad_messages`) when malformed."""
    if frames is None:
        return None
    try:
        header, arrays = decode(frames)
        kind = header["kind"]
        if kind == "credit" and not isinstance(header.get("slot"), int):
            raise WireError("credit without an int 'slot'")
        if kind == "weights" and not isinstance(header.get("version"), int):
            raise WireError("weights without an int 'version'")
        return header, arrays
    except WireError as exc:
        counter.bad_messages += 1
        log.warning("%s rejected a message (%d so far): %s", role, counter.bad_messages, exc)
        return None


def _fragment_from_header(header: dict[str, Any], arrays: dict[str, Any]) -> Fragment:
    meta = {k: header.get(k) for k in ("actor", "seq", "version", "env_steps")}
    for key, value in meta.items():
        if not isinstance(value, int) or value < 0:
            raise WireError(f"fragment header field {key!r} must be a non-negative int, got {value!r}")
    return Fragment(arrays, meta["actor"], meta["seq"], meta["version"], meta["env_steps"])


# ---------------------------------------------------------------- actor process


def role_pool(token: str, role: str, pid: int) -> Path:
    """The slot file of one role process. A restarted actor gets a new file: notices its dead
    predecessor left queued at the learner still point at the old one, which nobody rewrites
    (the driver unlinks it; a learner that mapped it keeps reading its own mapping)."""
    return pool_path(token, f"{role}-pid{pid}")


def actor_main(run: RunContext, endpoints: Endpoints, token: str, actor_id: int) -> None:
    _run_role(f"actor{actor_id}", run.cfg.topology.actor_threads, endpoints,
              lambda ctx, events: _actor_loop(run, endpoints, token, actor_id, ctx, events))


def _actor_loop(run: RunContext, endpoints: Endpoints, token: str, actor_id: int,
                ctx: zmq.Context, events: zmq.Socket) -> None:
    cfg = run.cfg
    link, weights, control, poller = _weights_client(ctx, endpoints)
    poller.unregister(weights)  # a waiting actor wakes for credits and stop, not for every publish
    actor = build_actor(cfg, actor_id)
    reporter = ActorReporter(actor)
    slots = SlotWriter(role_pool(token, f"actor{actor_id}", os.getpid()), cfg.balance.max_inflight)
    free_slots = deque(range(cfg.balance.max_inflight))  # our credits
    have_weights = False
    link.send(pack_header({"kind": "hello", "actor": actor_id}))
    last_event = time.time()
    try:
        while True:
            can_work = have_weights and bool(free_slots)
            started = time.perf_counter()
            ready = dict(poller.poll(0 if can_work else 100))
            if not can_work:
                reporter.wait_s += time.perf_counter() - started
            if control in ready and _stop_requested(control):
                break
            if link in ready:
                while link.poll(0):
                    message = _checked(link.recv_multipart(copy=False), f"actor{actor_id}", reporter)
                    if message is None:
                        continue
                    header, arrays = message
                    if header["kind"] == "credit":
                        free_slots.append(header["slot"])
                    elif header["kind"] == "weights":
                        actor.set_weights(header["version"], arrays)
                        have_weights = True
            if have_weights and free_slots:
                message = _checked(_newest(weights), f"actor{actor_id}", reporter)  # applied between fragments
                if message is not None and message[0]["version"] > actor.version:
                    actor.set_weights(message[0]["version"], message[1])
                fragment = actor.collect()
                slot = free_slots.popleft()
                header = slots.write(slot, fragment.arrays)
                header.update(kind="fragment", actor=actor_id, seq=fragment.seq,
                              version=fragment.policy_version, env_steps=fragment.env_steps)
                link.send(pack_header(header))
            if time.time() - last_event >= EVENT_INTERVAL_S:
                events.send(pack_header({**reporter.event(), "role": f"actor{actor_id}"}))
                last_event = time.time()
    finally:
        events.send(pack_header(reporter.event()))
        slots.close()
        actor.envs.close()


# ---------------------------------------------------------------- evaluator process


def evaluator_main(run: RunContext, endpoints: Endpoints, token: str) -> None:
    _run_role("evaluator", 1, endpoints, lambda ctx, events: _evaluator_loop(run, endpoints, ctx, events))


def _evaluator_loop(run: RunContext, endpoints: Endpoints, ctx: zmq.Context, events: zmq.Socket) -> None:
    """Greedy rounds on the newest weights, at most one per eval.interval_s, only when weights changed."""
    link, weights, control, poller = _weights_client(ctx, endpoints)
    poller.unregister(weights)  # read when a round is due, not on every publish
    evaluator = build_evaluator(run.cfg)
    link.send(pack_header({"kind": "hello", "role": "evaluator"}))
    last_round = last_event = 0.0
    while True:
        due_in_s = last_round + run.cfg.eval.interval_s - time.time()
        ready = dict(poller.poll(int(1000 * min(max(due_in_s, 0.05), 1.0))))  # no busy wait for new weights
        if control in ready and _stop_requested(control):
            break
        for newest in (_newest(link) if link in ready else None, _newest(weights)):
            message = _checked(newest, "evaluator", evaluator)
            if message is not None and message[0]["kind"] == "weights":
                evaluator.set_weights(message[0]["version"], message[1])
        now = time.time()
        if evaluator.has_new_weights() and now - last_round >= run.cfg.eval.interval_s:
            events.send(pack_header({**evaluator.evaluate(), "role": "evaluator"}))
            last_round = last_event = time.time()
        elif now - last_event >= 1.0:
            events.send(pack_header({"kind": "heartbeat", "role": "evaluator"}))
            last_event = now
    evaluator.envs.close()


# ---------------------------------------------------------------- learner process


def learner_main(run: RunContext, endpoints: Endpoints, token: str) -> None:
    _run_role("learner", run.cfg.topology.learner_threads, endpoints,
              lambda ctx, events: _learner_loop(run, endpoints, token, ctx, events))


def _learner_loop(run: RunContext, endpoints: Endpoints, token: str, ctx: zmq.Context, events: zmq.Socket) -> None:
    cfg = run.cfg
    router = _socket(ctx, zmq.ROUTER, endpoints.fragments, bind=True)
    publisher = _socket(ctx, zmq.PUB, endpoints.weights, bind=True)
    control = _socket(ctx, zmq.SUB, endpoints.control)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)

    learner = build_learner(cfg, run.checkpoint_dir if run.resumed else None)
    reporter = LearnerReporter(learner)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    weights_message = encode({"kind": "weights", "version": learner.version}, learner.weights())

    def handle(identity: bytes, frames: list[Any]) -> None:
        header = unpack_header(frames[0])
        if header["kind"] == "hello":
            router.send_multipart([identity, *weights_message])
        elif header["kind"] == "fragment":
            slot = header.get("slot")
            try:
                fragment = _fragment_from_header(header, reader.read(header))
            finally:  # the credit comes back even when the notice is rejected
                if isinstance(slot, int):
                    router.send_multipart([identity, pack_header({"kind": "credit", "slot": slot})])
            learner.consume(fragment)
        else:
            raise WireError(f"unexpected message kind {header['kind']!r}")

    def checkpoint() -> None:
        save_learner(run.checkpoint_dir, learner.state_dict())
        events.send(pack_header({"kind": "checkpoint", "version": learner.version}))

    last_event = last_checkpoint = time.time()
    while True:
        timeout = 0 if learner.ready() or not learner.wants_data() else 50
        started = time.perf_counter()
        ready = dict(poller.poll(timeout))
        reporter.wait_s += time.perf_counter() - started
        if control in ready and _stop_requested(control):
            break
        while learner.wants_data() and router.poll(0):
            identity, *frames = router.recv_multipart(copy=False)
            try:
                handle(identity.bytes, frames)
            except WireError as exc:
                reporter.bad_messages += 1
                if reporter.bad_messages <= 10 or reporter.bad_messages % 1000 == 0:
                    log.warning("learner rejected a message (%d so far): %s", reporter.bad_messages, exc)
        if learner.ready():
            learner.update()
            if learner.version % cfg.balance.publish_every == 0:
                weights_message = encode({"kind": "weights", "version": learner.version}, learner.weights())
                publisher.send_multipart(weights_message, copy=False)
        now = time.time()
        if now - last_event >= EVENT_INTERVAL_S:
            events.send(pack_header(reporter.event()))
            last_event = now
        if now - last_checkpoint >= cfg.checkpoint.interval_s:
            checkpoint()
            last_checkpoint = now
    checkpoint()
    events.send(pack_header(reporter.event()))
    events.send(pack_header({"kind": "stopped", "version": learner.version}))
    reader.close()


# ---------------------------------------------------------------- driver


def run_local(run: RunContext, monitor: Monitor) -> str:
    """Start the learner, actors and evaluator, supervise them until a stop condition, stop them cleanly."""
    cfg = run.cfg
    token = secrets.token_hex(6)
    endpoints = Endpoints.ipc(token)
    ctx = zmq.Context()
    events = _socket(ctx, zmq.PULL, endpoints.events, bind=True)
    control = _socket(ctx, zmq.PUB, endpoints.control, bind=True)
    mp = multiprocessing.get_context("fork")  # fast start; the driver runs no torch ops before forking

    def start(name: str, target: Callable[..., None], *args: Any) -> multiprocessing.Process:
        process = mp.Process(target=target, args=(run, endpoints, token, *args), name=name, daemon=True)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # children inherit "ignore Ctrl-C"
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        return process

    workers: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
        f"actor{i}": (actor_main, (i,)) for i in range(cfg.topology.actors)}
    if cfg.eval.interval_s is not None:
        workers["evaluator"] = (evaluator_main, ())
    roles = _Roles(start("learner", learner_main), workers, start, run.run_dir, token)
    try:
        return _supervise(run, monitor, events, roles)
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is bounded; let it finish
        try:
            _shutdown(run, monitor, events, control, roles)
        finally:
            ctx.destroy(linger=0)
            remove_pools(token)
            for path in endpoints.ipc_paths():
                path.unlink(missing_ok=True)
            signal.signal(signal.SIGINT, previous)


class _Roles:
    """The learner plus restartable workers (actors, evaluator), each known by name."""

    def __init__(self, learner: multiprocessing.Process,
                 workers: dict[str, tuple[Callable[..., None], tuple[Any, ...]]],
                 start: Callable[..., multiprocessing.Process], run_dir: Path, token: str):
        self.learner = learner
        self.token = token
        self.specs = workers
        self.start = start
        self.run_dir = run_dir
        self.workers = {name: start(name, target, *args) for name, (target, args) in workers.items()}
        self.last_seen: dict[str, float] = {}  # worker name -> time of its last event

    def all(self) -> list[multiprocessing.Process]:
        return [self.learner, *self.workers.values()]

    def write_pids(self) -> None:
        """roles.json: which process is which, for operators (and the fault-tolerance test)."""
        pids = {"learner": self.learner.pid, **{name: p.pid for name, p in self.workers.items()}}
        (self.run_dir / "roles.json").write_text(json.dumps(pids))

    def restart(self, name: str) -> None:
        target, args = self.specs[name]
        role_pool(self.token, name, self.workers[name].pid).unlink(missing_ok=True)  # the dead one's slots
        self.workers[name] = self.start(name, target, *args)
        self.last_seen[name] = time.time()
        self.write_pids()


def _handle_event(run: RunContext, monitor: Monitor, roles: _Roles, event: dict[str, Any]) -> None:
    kind = event["kind"]
    if isinstance(event.get("role"), str):
        roles.last_seen[event["role"]] = time.time()
    if kind == "checkpoint":
        save_driver(run.checkpoint_dir, monitor.state())
    elif kind == "error":
        log.error("%s failed:\n%s", event.get("role"), event.get("message"))
    else:
        monitor.on_event(event)


def _drain_events(run: RunContext, monitor: Monitor, roles: _Roles, events: zmq.Socket, timeout_ms: int) -> None:
    if events.poll(timeout_ms):
        while events.poll(0):
            try:
                event = unpack_header(events.recv())
            except WireError as exc:
                log.warning("driver rejected an event: %s", exc)
                continue
            _handle_event(run, monitor, roles, event)


def _supervise(run: RunContext, monitor: Monitor, events: zmq.Socket, roles: _Roles) -> str:
    started = time.time()
    roles.write_pids()
    while True:
        _drain_events(run, monitor, roles, events, timeout_ms=50)
        monitor.tick()
        reason = monitor.stop_reason()
        if reason is not None:
            return reason
        if not roles.learner.is_alive():
            raise RoleError(f"learner exited with code {roles.learner.exitcode}; see the log above")
        for name, process in list(roles.workers.items()):
            silent_s = time.time() - roles.last_seen.get(name, started)
            if process.is_alive() and silent_s < HEARTBEAT_TIMEOUT_S:
                continue
            monitor.totals["role_restarts"] += 1
            if monitor.totals["role_restarts"] > MAX_ROLE_RESTARTS:
                raise RoleError(f"workers failed {MAX_ROLE_RESTARTS} times; last: {name}, code {process.exitcode}")
            if process.is_alive():
                log.warning("%s sent no heartbeat for %.0f s; replacing it", name, silent_s)
                process.kill()
                process.join(1)
            else:
                log.warning("%s exited with code %s; restarting it", name, process.exitcode)
            roles.restart(name)


def _shutdown(run: RunContext, monitor: Monitor, events: zmq.Socket, control: zmq.Socket, roles: _Roles) -> None:
    """Ask every role to stop (the learner writes its final checkpoint), then make sure they are gone."""
    deadline = time.time() + STOP_GRACE_S
    while time.time() < deadline and any(p.is_alive() for p in roles.all()):
        control.send(pack_header({"kind": "stop"}))
        _drain_events(run, monitor, roles, events, timeout_ms=100)
    for process in roles.all():
        if process.is_alive():
            log.warning("%s did not stop in time; terminating it", process.name)
            process.terminate()
            process.join(2)
        if process.is_alive():
            process.kill()
        process.join(1)
    _drain_events(run, monitor, roles, events, timeout_ms=0)
