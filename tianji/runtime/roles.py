"""The role loops: learner, actor, evaluator. Each knows only its endpoints (`tianji.runtime.links`)
and its transport (shared-memory slots, `tianji.shm`); a launcher decides where it runs and calls
`*_main` as the body of a process.

Every role exits when the driver asks (stop), when the driver falls silent (it died: see
`DriverLink`) and, under the local launcher, at once when the driver process exits (a
parent-death signal), so a killed driver leaves no orphans.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any, Callable

import zmq

from tianji.checkpoint import save_learner
from tianji.runtime.actor import Fragment
from tianji.runtime.balance import CreditLedger
from tianji.runtime.build import build_actor, build_evaluator, build_learner
from tianji.runtime.events import ActorReporter, LearnerReporter
from tianji.runtime.links import (DriverGone, DriverLink, Endpoints, LearnerLink, die_with_parent, log, log_rejected,
                                  socket)
from tianji.runtime.run import RunContext
from tianji.shm import SlotReader, SlotWriter, pool_path
from tianji.wire import WireError, encode, pack_header, unpack_header

EVENT_INTERVAL_S = 0.1
MAX_SLOTS = 1024  # an actor announcing more slots than this is refused


# ---------------------------------------------------------------- process body shared by every role


def run_role(name: str, run: RunContext, threads: int, endpoints: Endpoints, driver_pid: int | None,
             loop: Callable[[zmq.Context, zmq.Socket, DriverLink], None]) -> None:
    """Process body of every role: signals, threads, the driver link, the loop, a crash report."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; roles stop by message
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(driver_pid)
    torch.set_num_threads(threads)
    ctx = zmq.Context()
    events = socket(ctx, zmq.PUSH, endpoints.events)
    driver = DriverLink(socket(ctx, zmq.SUB, endpoints.control), run.cfg.supervision.driver_timeout_s)
    try:
        loop(ctx, events, driver)
    except DriverGone as exc:
        log.warning("%s exits: %s", name, exc)
    except Exception:
        events.send(pack_header({"kind": "error", "role": name, "message": traceback.format_exc()}))
        raise
    finally:
        ctx.destroy(linger=1000)


def _orders(driver: DriverLink, learner: LearnerLink | None = None) -> bool:
    """Follow the driver: True when it asks to stop; a restarted learner gets a hello."""
    stop = False
    for order in driver.poll():
        stop |= order["kind"] == "stop"
        if order["kind"] == "learner_restarted" and learner is not None:
            learner.follow_restart(order.get("epoch"))
    return stop


# ---------------------------------------------------------------- actor


def role_pool(token: str, role: str, pid: int):
    """The slot file of one role process. A restarted actor gets a new file: notices its dead
    predecessor left queued at the learner still point at the old one, which nobody rewrites."""
    return pool_path(token, f"{role}-pid{pid}")


def actor_main(run: RunContext, endpoints: Endpoints, token: str, driver_pid: int | None, actor_id: int) -> None:
    run_role(f"actor{actor_id}", run, run.cfg.topology.actor_threads, endpoints, driver_pid,
             lambda ctx, events, driver: actor_loop(run, endpoints, token, actor_id, ctx, events, driver))


def actor_loop(run: RunContext, endpoints: Endpoints, token: str, actor_id: int,
               ctx: zmq.Context, events: zmq.Socket, driver: DriverLink) -> None:
    """Collect a fragment whenever the learner has granted a slot and the weights are new enough for it."""
    cfg = run.cfg
    name = f"actor{actor_id}"
    slots_count = cfg.balance.max_inflight
    learner = LearnerLink(ctx, endpoints, name, {"kind": "hello", "actor": actor_id, "slots": slots_count})
    actor = build_actor(cfg, actor_id)
    reporter = ActorReporter(actor)
    slots = SlotWriter(role_pool(token, name, os.getpid()), slots_count)
    idle = zmq.Poller()  # waiting for a credit: wake for the learner and the driver, not for every publish
    for sock in (learner.link, driver.sock):
        idle.register(sock, zmq.POLLIN)
    stale = zmq.Poller()  # holding a credit that asks for newer weights: wake for a publish too
    for sock in (learner.link, driver.sock, learner.weights):
        stale.register(sock, zmq.POLLIN)

    def can_start() -> bool:
        if not (learner.has_weights and learner.credits):
            return False
        learner.newest_weights(actor)  # applied between fragments, only when one is about to start
        if actor.version >= learner.credits[0][1]:
            return True
        learner.ask_for_weights()  # not published yet, or lost on the way: the reply to a hello has them
        return False

    last_event = time.time()
    try:
        while True:
            if not can_start():
                started = time.perf_counter()
                (stale if learner.credits else idle).poll(100)
                reporter.wait_s += time.perf_counter() - started
            if _orders(driver, learner):
                break
            learner.receive(actor)
            if can_start():
                slot, _ = learner.credits.popleft()
                fragment = actor.collect()
                header = slots.write(slot, fragment.arrays)
                header.update(kind="fragment", actor=actor_id, seq=fragment.seq, version=fragment.policy_version,
                              env_steps=fragment.env_steps, epoch=learner.epoch)
                learner.send(header)
            if time.time() - last_event >= EVENT_INTERVAL_S:
                reporter.bad_messages = learner.bad_messages
                events.send(pack_header(reporter.event()))
                last_event = time.time()
    finally:
        events.send(pack_header(reporter.event()))
        slots.close()
        actor.envs.close()


# ---------------------------------------------------------------- evaluator


def evaluator_main(run: RunContext, endpoints: Endpoints, token: str, driver_pid: int | None) -> None:
    run_role("evaluator", run, 1, endpoints, driver_pid,
             lambda ctx, events, driver: evaluator_loop(run, endpoints, ctx, events, driver))


def evaluator_loop(run: RunContext, endpoints: Endpoints, ctx: zmq.Context, events: zmq.Socket,
                   driver: DriverLink) -> None:
    """Greedy rounds on the newest weights, at most one per eval.interval_s, only when weights changed."""
    learner = LearnerLink(ctx, endpoints, "evaluator", {"kind": "hello", "role": "evaluator"})
    evaluator = build_evaluator(run.cfg)
    poller = zmq.Poller()  # weights are read when a round is due, not on every publish
    for sock in (learner.link, driver.sock):
        poller.register(sock, zmq.POLLIN)
    last_round = last_event = 0.0
    while True:
        due_in_s = last_round + run.cfg.eval.interval_s - time.time()
        poller.poll(int(1000 * min(max(due_in_s, 0.05), 1.0)))  # no busy wait for new weights
        if _orders(driver, learner):
            break
        learner.receive(evaluator)
        learner.newest_weights(evaluator)
        evaluator.bad_messages = learner.bad_messages
        now = time.time()
        if evaluator.has_new_weights() and now - last_round >= run.cfg.eval.interval_s:
            events.send(pack_header({**evaluator.evaluate(), "role": "evaluator"}))
            last_round = last_event = time.time()
        elif now - last_event >= 1.0:
            events.send(pack_header({"kind": "heartbeat", "role": "evaluator"}))
            last_event = now
    evaluator.envs.close()


# ---------------------------------------------------------------- learner


def learner_main(run: RunContext, endpoints: Endpoints, token: str, driver_pid: int | None, epoch: int = 0) -> None:
    run_role("learner", run, run.cfg.topology.learner_threads, endpoints, driver_pid,
             lambda ctx, events, driver: learner_loop(run, endpoints, token, epoch, ctx, events, driver))


def fragment_from_header(header: dict[str, Any], arrays: dict[str, Any]) -> Fragment:
    meta = {k: header.get(k) for k in ("actor", "seq", "version", "env_steps")}
    for key, value in meta.items():
        if not isinstance(value, int) or value < 0:
            raise WireError(f"fragment header field {key!r} must be a non-negative int, got {value!r}")
    return Fragment(arrays, meta["actor"], meta["seq"], meta["version"], meta["env_steps"])


def _slots_announced(header: dict[str, Any], default: int) -> tuple[int, int]:
    actor, slots = header.get("actor"), header.get("slots", default)
    if not (isinstance(actor, int) and actor >= 0):
        raise WireError(f"hello: 'actor' must be a non-negative int, got {actor!r}")
    if not (isinstance(slots, int) and 1 <= slots <= MAX_SLOTS):
        raise WireError(f"hello: 'slots' must be an int in [1, {MAX_SLOTS}], got {slots!r}")
    return actor, slots


def learner_loop(run: RunContext, endpoints: Endpoints, token: str, epoch: int,
                 ctx: zmq.Context, events: zmq.Socket, driver: DriverLink) -> None:
    """Take fragments while the buffer has room, train when ready, publish weights, grant credits.

    `epoch` > 0: a restart after a crash; the learner resumes from the last checkpoint.
    """
    cfg = run.cfg
    router = socket(ctx, zmq.ROUTER, endpoints.fragments, bind=True)
    publisher = socket(ctx, zmq.PUB, endpoints.weights, bind=True)
    poller = zmq.Poller()
    for sock in (router, driver.sock):
        poller.register(sock, zmq.POLLIN)

    learner = build_learner(cfg, run.checkpoint_dir if run.resumed or epoch > 0 else None)
    reporter = LearnerReporter(learner)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    credits = CreditLedger(cfg.balance.max_policy_lag, lag_aware=cfg.balance.backpressure)

    def weights_message() -> list[Any]:
        return encode({"kind": "weights", "version": learner.version, "epoch": epoch}, learner.weights())

    latest_weights, published = weights_message(), learner.version

    def handle(identity: bytes, frames: list[Any]) -> None:
        header = unpack_header(frames[0])
        if header["kind"] == "hello":
            if "actor" in header:  # the evaluator says hello too, but fills no slots
                actor_id, slots = _slots_announced(header, cfg.balance.max_inflight)
                credits.register(actor_id, identity, slots)
            router.send_multipart([identity, *latest_weights])
        elif header["kind"] == "fragment":
            if header.get("epoch") != epoch:  # for a learner before a restart: its slot was granted anew
                reporter.stale_notices += 1
                return
            slot = header.get("slot")
            if not credits.arrived(identity, slot):
                raise WireError(f"fragment notice for slot {slot!r}, which was not granted to its sender")
            try:
                fragment = fragment_from_header(header, reader.read(header))
            finally:  # read or rejected, the slot is the learner's again
                credits.release(identity, slot)
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
        poller.poll(timeout)
        reporter.wait_s += time.perf_counter() - started
        if _orders(driver):
            break
        while learner.wants_data() and router.poll(0):
            identity, *frames = router.recv_multipart(copy=False)
            try:
                handle(identity.bytes, frames)
            except WireError as exc:
                reporter.bad_messages += 1
                log_rejected("learner", reporter.bad_messages, exc)
        if learner.ready():
            learner.update()
            if learner.version % cfg.balance.publish_every == 0:
                latest_weights, published = weights_message(), learner.version
                publisher.send_multipart(latest_weights, copy=False)
        for identity, slot, min_version in credits.grant(learner.version, learner.versions_per_fragment, published):
            router.send_multipart([identity, pack_header(
                {"kind": "credit", "slot": slot, "min_version": min_version, "epoch": epoch})])
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
