"""The role loops: learner, actor, evaluator. Each knows only its endpoints and its transport
(`tianji.runtime.transport.sockets`: shared-memory slots on one machine, array frames across machines); a
launcher decides where it runs and calls `*_main` (or `run_role` with a loop) as a process body.

Every role exits when the driver asks (stop), when the driver falls silent (it died: see
`DriverLink`) and, under the local launcher, at once when the driver process exits (a
parent-death signal), so a killed driver leaves no orphans.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from tianji.config import Config
from tianji.runtime.process.life import die_with_parent
from tianji.runtime.roles.actor import Fragment
from tianji.runtime.roles.build import build_actor, build_evaluator, build_learner
from tianji.runtime.roles.learner import Learner
from tianji.runtime.roles.links import DriverGone, DriverLink, FrameSender, LearnerLink, SlotSender
from tianji.runtime.roles.reporters import ActorReporter
from tianji.runtime.roles.service import EVENT_INTERVAL_S, LearnerService, learner_of
from tianji.runtime.shared.checkpoint import FileStore, ShippedStore
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.events import heartbeat, measured, role_error, stopped
from tianji.runtime.shared.logs import log, log_rejected
from tianji.runtime.shared.protocol import (
    TO_LEARNER,
    Credit,
    FragmentNotice,
    Hello,
    LearnerRestarted,
    Message,
    Probe,
    Stop,
    Weights,
    parse,
)
from tianji.runtime.sync import (
    GroupSpec,
    GroupStopping,
    broadcast_from_first,
    join_group,
    leave_group,
    make_sync,
    measure_group,
)
from tianji.runtime.transport.security import Gatekeeper
from tianji.runtime.transport.shm import SlotReader, pool_path
from tianji.runtime.transport.sockets import Endpoints, bound_endpoint, socket
from tianji.runtime.transport.wire import WireError, decode, encode, pack_header, unpack_header

# ---------------------------------------------------------------- process body shared by every role


def run_role(
    name: str,
    run: RunContext,
    threads: int,
    endpoints: Endpoints,
    loop: Callable[[zmq.Context[Any], zmq.Socket[Any], DriverLink], None],
    driver_pid: int | None = None,
    ctx: zmq.Context[Any] | None = None,
    own_process: bool = True,
    nice: int = 0,
) -> None:
    """Body of every role: signals and priority (when it owns its process), threads, the driver link,
    the loop, a crash report to the driver."""
    if own_process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; roles stop by message
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent(driver_pid)
        os.nice(nice)  # actors yield the cores to the learner they all wait for (topology.actor_nice)
    torch.set_num_threads(threads)
    ctx = ctx or zmq.Context()
    events = socket(ctx, zmq.PUSH, endpoints.events, keys=endpoints.keys)
    driver = DriverLink(
        socket(ctx, zmq.SUB, endpoints.control, keys=endpoints.keys), run.cfg.supervision.driver_timeout_s
    )
    try:
        loop(ctx, events, driver)
    except DriverGone as exc:
        log.warning("%s exits: %s", name, exc)
    except Exception:
        events.send(pack_header(role_error(name, traceback.format_exc())))
        raise
    finally:
        ctx.destroy(linger=1000)


def _orders(driver: DriverLink, learner: LearnerLink | None = None) -> bool:
    """Follow the driver: True when it asks to stop; a restarted learner gets a hello."""
    stop = False
    for order in driver.poll():
        stop |= isinstance(order, Stop)
        if isinstance(order, LearnerRestarted) and learner is not None:
            learner.follow_restart(order)
    return stop


# ---------------------------------------------------------------- actor


def role_pool(token: str, role: str, pid: int) -> Path:
    """The slot file of one role process. A restarted actor gets a new file: notices its dead
    predecessor left queued at the learner still point at the old one, which nobody rewrites."""
    return pool_path(token, f"{role}-pid{pid}")


def actor_main(run: RunContext, endpoints: Endpoints, token: str, driver_pid: int | None, actor_id: int) -> None:
    run_role(
        f"actor{actor_id}",
        run,
        run.cfg.topology.actor_threads,
        endpoints,
        lambda ctx, events, driver: actor_loop(run, endpoints, token, actor_id, ctx, events, driver),
        driver_pid=driver_pid,
        nice=run.cfg.topology.actor_nice,
    )


def actor_loop(
    run: RunContext,
    endpoints: Endpoints,
    token: str,
    actor_id: int,
    ctx: zmq.Context[Any],
    events: zmq.Socket[Any],
    driver: DriverLink,
    same_machine: bool = True,
) -> None:
    """Collect a fragment whenever the learner has granted a slot and the weights are new enough for it.
    `same_machine`: the learner can map this actor's shared memory; else arrays travel as frames."""
    cfg = run.cfg
    name = f"actor{actor_id}"
    slots_count = cfg.balance.slots_per_actor
    learner = LearnerLink(
        ctx,
        endpoints,
        name,
        Hello(actor=actor_id, slots=slots_count),
        learner_rank=learner_of(cfg, actor_id),
    )
    actor = build_actor(cfg, actor_id)
    reporter = ActorReporter(actor)
    sender = SlotSender(role_pool(token, name, os.getpid()), slots_count) if same_machine else FrameSender()
    if not same_machine:
        _report_link(name, learner.measure(actor), events)
    idle = zmq.Poller()  # waiting for a credit: wake for the learner and the driver, not for every publish
    for sock in (learner.link, driver.sock, learner.monitor):
        idle.register(sock, zmq.POLLIN)
    stale = zmq.Poller()  # holding a credit that asks for newer weights: wake for a publish too
    for sock in (learner.link, driver.sock, learner.weights, learner.monitor):
        stale.register(sock, zmq.POLLIN)

    def can_start() -> bool:
        if not (learner.has_weights and learner.credits):
            return False
        _, version, exact = learner.credits[0]
        if exact is not None:  # a deterministic schedule: exactly these weights, whatever is newer
            actor.set_weights(version, exact, force=True)
            return True
        learner.newest_weights(actor)  # applied between fragments, only when one is about to start
        if actor.version >= learner.credits[0][1]:
            return True
        learner.ask_for_weights()  # not published yet, or lost on the way: the reply to a hello has them
        return False

    # balance.refresh_weights=step: weights published mid-fragment act from the next env step on
    between_steps = partial(learner.newest_weights, actor) if cfg.balance.refresh_weights == "step" else None
    last_event = time.time()
    try:
        while True:
            if not can_start():
                started = time.perf_counter()
                (stale if learner.credits else idle).poll(100)
                reporter.wait_s += time.perf_counter() - started
            if _orders(driver, learner):
                break
            learner.check_link()  # a link that came back after a cut says hello again
            learner.receive(actor)
            if can_start():
                slot, *_ = learner.credits.popleft()
                fragment = actor.collect(sender.views(slot), between_steps)  # rows straight into the slot
                notice = FragmentNotice(
                    slot, learner.epoch, actor_id, fragment.seq, fragment.policy_version, fragment.env_steps
                )
                sender.send(learner.link, notice, fragment.arrays)
                learner.sent_fragment(slot)
            if time.time() - last_event >= EVENT_INTERVAL_S:
                reporter.bad_messages = learner.bad_messages
                events.send(pack_header(reporter.event()))
                last_event = time.time()
    finally:
        events.send(pack_header(reporter.event()))
        sender.close()
        actor.envs.close()


def _report_link(name: str, costs: dict[str, float] | None, events: zmq.Socket[Any]) -> None:
    """Log a TCP link's measured latency and rate and tell the driver (summary: measured_costs)."""
    if costs is None:
        log.warning("%s: the learner did not echo the link probe in time; link not measured", name)
        return
    rate = costs.get("link_bytes_per_s")
    log.info(
        "%s: link to its learner: %.0f us, %s (%.1f MB probes)",
        name,
        costs["link_latency_s"] * 1e6,
        f"{rate / 1e6:.0f} MB/s" if rate else "rate hidden in the noise",
        costs["link_probe_bytes"] / 1e6,
    )
    events.send(pack_header(measured(name, costs)))


# ---------------------------------------------------------------- evaluator


def evaluator_main(run: RunContext, endpoints: Endpoints, token: str, driver_pid: int | None) -> None:
    run_role(
        "evaluator",
        run,
        1,
        endpoints,
        lambda ctx, events, driver: evaluator_loop(run, endpoints, ctx, events, driver),
        driver_pid=driver_pid,
        nice=run.cfg.topology.actor_nice,
    )


def evaluator_loop(
    run: RunContext, endpoints: Endpoints, ctx: zmq.Context[Any], events: zmq.Socket[Any], driver: DriverLink
) -> None:
    """Greedy rounds on the newest weights, at most one per eval.interval_s, only when weights changed."""
    learner = LearnerLink(ctx, endpoints, "evaluator", Hello(role="evaluator"))
    evaluator = build_evaluator(run.cfg)
    poller = zmq.Poller()  # weights are read when a round is due, not on every publish
    for sock in (learner.link, driver.sock):
        poller.register(sock, zmq.POLLIN)
    last_round = last_event = 0.0
    interval_s = run.cfg.eval.interval_s or 0.0  # the evaluator runs only with eval.interval_s
    while True:
        due_in_s = last_round + interval_s - time.time()
        poller.poll(int(1000 * min(max(due_in_s, 0.05), 1.0)))  # no busy wait for new weights
        if _orders(driver, learner):
            break
        learner.receive(evaluator)
        learner.newest_weights(evaluator)
        evaluator.bad_messages = learner.bad_messages
        now = time.time()
        if evaluator.has_new_weights() and now - last_round >= interval_s:
            events.send(pack_header(evaluator.evaluate()))
            last_round = last_event = time.time()
        elif now - last_event >= 1.0:
            events.send(pack_header(heartbeat("evaluator")))
            last_event = now
    evaluator.envs.close()


# ---------------------------------------------------------------- learner


def learner_main(
    run: RunContext,
    endpoints: Endpoints,
    token: str,
    driver_pid: int | None,
    epoch: int = 0,
    rank: int = 0,
    group: GroupSpec | None = None,
) -> None:
    def loop(ctx: zmq.Context[Any], events: zmq.Socket[Any], driver: DriverLink) -> None:
        learner_loop(
            run,
            token,
            epoch,
            bind_learner(ctx, endpoints),
            FileStore(run.checkpoint_dir, rank, epoch),
            events,
            driver,
            rank,
            group,
        )

    run_role(f"learner{rank}", run, run.cfg.topology.learner_threads, endpoints, loop, driver_pid=driver_pid)


@dataclass
class LearnerSockets:
    """The learner's listening sockets; with TCP, the gatekeeper that refuses peers without the run's key."""

    router: zmq.Socket[Any]  # hello, fragment notices in; weights replies, credits out
    publisher: zmq.Socket[Any]  # weights, newest wins
    gate: Gatekeeper | None

    @property
    def endpoints(self) -> dict[str, str]:
        return {"fragments": bound_endpoint(self.router), "weights": bound_endpoint(self.publisher)}


def bind_learner(ctx: zmq.Context[Any], endpoints: Endpoints) -> LearnerSockets:
    """Bind where `endpoints` say (a TCP port `*` picks a free one; see `LearnerSockets.endpoints`)."""
    gate = Gatekeeper(ctx, endpoints.keys) if endpoints.keys is not None else None
    return LearnerSockets(
        socket(ctx, zmq.ROUTER, endpoints.fragments, bind=True, keys=endpoints.keys),
        socket(ctx, zmq.PUB, endpoints.weights, bind=True, keys=endpoints.keys),
        gate,
    )


class LearnerEndpoint:
    """The learner's messages over its sockets: each kind from an actor dispatched to its handler
    (hello, probe, fragment notice), and what the service returns sent back (weights, credits)."""

    def __init__(self, sockets: LearnerSockets, service: LearnerService[bytes], reader: SlotReader, epoch: int):
        self.router, self.publisher = sockets.router, sockets.publisher
        self.service, self.reader, self.epoch = service, reader, epoch
        self.handlers: dict[type[Message], Callable[[bytes, Any, list[Any]], None]] = {
            Hello: self.on_hello,
            Probe: self.on_probe,
            FragmentNotice: self.on_fragment,
        }

    def handle(self, identity: bytes, frames: list[Any]) -> None:
        """One message from a peer; WireError (the caller counts it) when it is malformed."""
        header = unpack_header(frames[0])
        try:
            message = parse(header, TO_LEARNER)
        except WireError:
            if header.get("kind") == FragmentNotice.kind and header.get("epoch") == self.epoch:
                self.service.give_back(identity, header.get("slot"))  # a granted slot stays its actor's
            raise
        self.handlers[type(message)](identity, message, frames)

    def on_hello(self, identity: bytes, hello: Hello, frames: list[Any]) -> None:
        version, weights = self.service.hello(identity, hello)
        reply = Weights(version, self.epoch, resync=hello.resync is not None)
        self.router.send_multipart([identity, *encode(reply.header(), weights)])

    def on_probe(self, identity: bytes, probe: Probe, frames: list[Any]) -> None:
        """An actor on another machine times its link: echo it now."""
        self.router.send_multipart([identity, pack_header(Probe(probe.n).header())])

    def on_fragment(self, identity: bytes, notice: FragmentNotice, frames: list[Any]) -> None:
        if not self.service.notice(identity, notice):
            return
        try:  # arrays in the sender's shared memory (same machine), or in frames after the notice
            if notice.in_shared_memory:
                arrays = self.reader.read(notice.header(), copy=not self.service.trains_in_slot)
            else:
                arrays = decode(frames)[1]
                self.service.reporter.fragments_in_frames += 1
        except Exception:
            self.service.reject(identity, notice.slot)
            raise
        fragment = Fragment(arrays, notice.actor, notice.seq, notice.version, notice.env_steps)
        self.service.take(identity, notice.slot, fragment, in_slot=notice.in_shared_memory)

    def publish(self, version: int, weights: Any) -> None:
        self.publisher.send_multipart(encode(Weights(version, self.epoch).header(), weights), copy=False)

    def send_credits(self) -> None:
        for grant in self.service.grants():
            credit = Credit(grant.slot, grant.min_version, self.epoch, exact=grant.weights is not None)
            self.router.send_multipart([grant.peer, *encode(credit.header(), grant.weights)], copy=False)


def learner_loop(
    run: RunContext,
    token: str,
    epoch: int,
    sockets: LearnerSockets,
    store: FileStore | ShippedStore,
    events: zmq.Socket[Any],
    driver: DriverLink,
    rank: int = 0,
    group: GroupSpec | None = None,
    group_store: dist.TCPStore | None = None,
) -> None:
    """Carry the learner service's messages over sockets: hellos and fragment notices in, weights
    replies, publishes and credits out; events and checkpoints to the driver when the service says.

    `epoch` > 0: a restart after a crash; the learner resumes from the last checkpoint in `store`.
    `group`: one of several learners, kept in step through torch.distributed (tianji.runtime.sync).
    """
    cfg = run.cfg
    learner = build_learner(cfg, store.load(restart=epoch > 0) if run.resumed or epoch > 0 else None)
    if group is not None:
        events.send(pack_header(measured(f"learner{rank}", _join_learner_group(learner, cfg, group, group_store))))
    service: LearnerService[bytes] = LearnerService(learner, cfg, epoch, rank)
    reader = SlotReader(allowed_prefix=f"tianji-{token}-")
    endpoint = LearnerEndpoint(sockets, service, reader, epoch)
    poller = zmq.Poller()
    for sock in (sockets.router, driver.sock):
        poller.register(sock, zmq.POLLIN)
    while True:
        _wait_for_work(poller, service)
        if _orders(driver):
            service.stop()  # with a group, stopping is a collective: the others leave with it
            break
        _take_messages(endpoint, rank)
        try:
            published = service.step()
        except GroupStopping:  # another learner of the group is stopping
            break
        if published is not None:
            endpoint.publish(*published)
        endpoint.send_credits()
        if service.event_due():
            events.send(pack_header(_learner_event(service, sockets)))
        if service.checkpoint_due():
            events.send_multipart(store.save(learner.state_dict()))
    events.send_multipart(store.save(learner.state_dict()))
    events.send(pack_header(service.reporter.event()))
    events.send(pack_header(stopped(learner.version)))
    reader.close()
    if sockets.gate is not None:
        sockets.gate.stop()
    if group is not None:
        leave_group()


def _learner_event(service: LearnerService[bytes], sockets: LearnerSockets) -> dict[str, Any]:
    service.reporter.refused_peers = sockets.gate.refused if sockets.gate is not None else 0
    return dict(service.reporter.event())


def _wait_for_work(poller: zmq.Poller, service: LearnerService[bytes]) -> None:
    """Wait for a message unless an update is ready (or the buffer is full); the wait is measured."""
    timeout = 0 if service.ready() or not service.wants_data() else 50
    started = time.perf_counter()
    poller.poll(timeout)
    service.reporter.wait_s += time.perf_counter() - started


def _take_messages(endpoint: LearnerEndpoint, rank: int) -> None:
    """Every waiting message while the learner wants data; a malformed one is counted, logged and dropped."""
    service, router = endpoint.service, endpoint.router
    while service.wants_data() and router.poll(0):
        identity, *frames = router.recv_multipart(copy=False)
        try:
            endpoint.handle(identity.bytes, frames)
        except WireError as exc:
            service.reporter.bad_messages += 1
            log_rejected(f"learner{rank}", service.reporter.bad_messages, exc)


def _join_learner_group(
    learner: Learner, cfg: Config, group: GroupSpec, group_store: dist.TCPStore | None
) -> dict[str, float]:
    """Form the process group and start from rank 0's parameters, moments and version (after a
    resume each learner loaded its own checkpoint; in allreduce mode they must be identical).
    Returns the group's collective costs, measured with a bucket of the model's size."""
    if getattr(learner.algo, "device", torch.device("cpu")).type == "cuda":
        group = replace(group, backend="nccl")  # gradients stay on the GPUs
    join_group(group, group_store)
    sync = make_sync(cfg.sync.mode, group.world_size, cfg.sync.every, cfg.sync.average_optimizer)
    learner.attach_sync(sync)
    version = torch.tensor([float(learner.version)])
    broadcast_from_first([*learner.algo.parameters(), *learner.algo.optimizer_moments(), version])
    learner.version = int(version.item())
    sync.started(learner.algo.parameters())
    parameters = list(learner.algo.parameters())
    costs = measure_group(sum(p.numel() for p in parameters), parameters[0].device)
    log.info(
        "learner%d: group of %d, all_reduce of one number %.0f us, of its %.0f kB bucket %.0f us; %.1f MB/s",
        group.rank,
        group.world_size,
        costs["allreduce_latency_s"] * 1e6,
        costs["allreduce_bucket_bytes"] / 1e3,
        costs["allreduce_bucket_s"] * 1e6,
        costs["allreduce_bytes_per_s"] / 1e6,
    )
    return costs
