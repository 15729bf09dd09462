"""Each role's view of the others: the driver's orders (`DriverLink`), the learner's weights and credits
(`LearnerLink`), and how a fragment reaches the learner (`SlotSender` on one machine, `FrameSender` across).
The message table is in tianji.runtime.transport.sockets."""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from tianji.runtime.shared.logs import log_rejected
from tianji.runtime.shared.protocol import (
    ORDERS,
    TO_ACTOR,
    Credit,
    FragmentNotice,
    Heartbeat,
    Hello,
    LearnerRestarted,
    Message,
    Probe,
    Weights,
    parse,
)
from tianji.runtime.transport.shm import SlotWriter
from tianji.runtime.transport.sockets import Endpoints, newest, socket
from tianji.runtime.transport.wire import WireError, decode, encode, pack_header, unpack_header

PROBE_BYTES = 1 << 20  # a link probe's payload: enough that its transfer, not the latency, sets its time


class DriverGone(Exception):
    """The driver fell silent for longer than supervision.driver_timeout_s: the role exits."""


class DriverLink:
    """A role's view of the driver: its orders (stop, learner_restarted) and whether it is still there.

    driver = DriverLink(socket(ctx, zmq.SUB, endpoints.control), silence_s=5.0)
    for order in driver.poll():   # raises DriverGone after silence_s without a message
        ...
    """

    def __init__(self, sock: zmq.Socket[Any], silence_s: float, clock: Callable[[], float] = time.monotonic):
        self.sock = sock
        self.silence_s = silence_s
        self.clock = clock
        self.last_heard = clock()

    def poll(self) -> list[Message]:
        orders: list[Message] = []
        while self.sock.poll(0):
            self.last_heard = self.clock()
            try:
                order = parse(unpack_header(self.sock.recv()), ORDERS)
            except WireError:
                continue
            if not isinstance(order, Heartbeat):
                orders.append(order)
        if self.clock() - self.last_heard > self.silence_s:
            raise DriverGone(f"no message from the driver for {self.silence_s:.0f} s")
        return orders


class WeightsTaker(Protocol):
    """An actor or the evaluator: takes versioned weights (`force` after a learner restart)."""

    version: int

    def set_weights(self, version: int, weights: Any, force: bool = False) -> None: ...


class LearnerLink:
    """An actor's or the evaluator's connection to the learner: hello, credits, weights.

        learner = LearnerLink(ctx, endpoints, "actor0", hello=Hello(actor=0, slots=2))
        learner.receive(actor)          # weights replies and credits
        learner.newest_weights(actor)   # newest published weights, when they are needed
        slot, min_version, exact = learner.credits.popleft()

    The reply to a hello names the learner's epoch; a new epoch means a restarted learner, which
    owns every slot again and grants them anew, so the credits held for the old one are dropped.

    A cut link (a TCP connection to a learner on another machine) heals itself: ZeroMQ reconnects, the
    link keeps its identity (the learner's ROUTER hands it over), and on reconnecting the link says hello
    again with the credits it still holds and the fragments it sent that no credit has answered yet
    (`resync`). The learner voids every other grant of this actor and counts the fragments that were lost
    on the way; until its reply the link ignores credits, which may predate the resync.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoints: Endpoints, role: str, hello: Hello, learner_rank: int = 0):
        self.endpoints = endpoints
        self.learner_rank = learner_rank
        identity = f"{role}-{os.getpid()}-{secrets.token_hex(4)}".encode()  # one per process: a restart is new
        self.link = socket(ctx, zmq.DEALER, endpoints.fragments, keys=endpoints.keys, identity=identity)
        self.weights = socket(ctx, zmq.SUB, endpoints.weights, keys=endpoints.keys)
        self.monitor = self.link.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.role = role
        self.hello = hello
        self.epoch = -1  # none yet: no weights
        self.credits: deque[tuple[int, int, Any]] = deque()  # (slot, min_version, exact weights or None)
        self.sent: set[int] = set()  # slots whose fragment went out and whose credit has not come back
        self.bad_messages = 0
        self.resyncs = 0
        self._link_down = False
        self._resyncing = False
        self._waiting_since: float | None = None
        self.link.send(pack_header(hello.header()))

    def sent_fragment(self, slot: int) -> None:
        """A fragment went out in `slot`: until its credit comes back it is in flight."""
        self.sent.add(slot)

    def check_link(self) -> None:
        """Follow the link's connection events; after a reconnect, say hello again with what this side holds."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._link_down = True
            elif event == zmq.EVENT_CONNECTED and self._link_down:
                self._link_down = False
                self._resync()

    def _resync(self) -> None:
        held = [slot for slot, *_ in self.credits]
        self.link.send(pack_header(self.hello.with_resync(held, sorted(self.sent)).header()))
        self.credits.clear()  # granted anew in the reply's wake; credits that cross it are void
        self.sent.clear()
        self._resyncing = True
        self.resyncs += 1

    @property
    def has_weights(self) -> bool:
        return self.epoch >= 0

    def ask_for_weights(self, after_s: float = 1.0) -> None:
        """Repeat the hello (its reply carries the newest weights) when a credit has waited `after_s`
        for a version the weights socket has not brought: publishes past its queue limit are dropped."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since >= after_s:
            self.link.send(pack_header(self.hello.header()))
            self._waiting_since = now

    def follow_restart(self, order: LearnerRestarted) -> None:
        """The driver restarted the learner: say hello to the new one, at its new address if it moved."""
        if order.epoch == self.epoch:
            return
        where = order.endpoints_of(self.learner_rank)
        for name, sock in (("fragments", self.link), ("weights", self.weights)):
            new, old = where.get(name), getattr(self.endpoints, name)
            if new is not None and new != old:
                sock.disconnect(old)
                sock.connect(new)
                self.endpoints = (
                    replace(self.endpoints, fragments=new)
                    if name == "fragments"
                    else replace(self.endpoints, weights=new)
                )
        self.link.send(pack_header(self.hello.header()))

    def receive(self, taker: WeightsTaker) -> None:
        while self.link.poll(0):
            message = self._checked(self.link.recv_multipart(copy=False))
            if message is not None:
                self._take(*message, taker)

    def measure(
        self, taker: WeightsTaker, payload_bytes: int = PROBE_BYTES, repeats: int = 3, timeout_s: float = 5.0
    ) -> dict[str, float] | None:
        """This link's latency and rate from round trips the learner echoes when it reads its socket:
        empty probes (latency: half the shortest round trip) and probes of `payload_bytes` (rate: those
        bytes over the time they add; the shortest of each, as waiting only ever adds). Weights and
        credits that arrive meanwhile are taken as usual. None when the learner does not answer
        within `timeout_s` in all."""
        deadline = time.perf_counter() + timeout_s
        empty = self._round_trip(taker, 0, repeats, deadline)
        full = self._round_trip(taker, payload_bytes, repeats, deadline) if empty is not None else None
        if empty is None or full is None:
            return None
        costs = {"link_latency_s": empty / 2, "link_probe_bytes": float(payload_bytes)}
        if full > empty:  # else the transfer hid in the noise: no rate rather than an absurd one
            costs["link_bytes_per_s"] = payload_bytes / (full - empty)
        return costs

    def _round_trip(self, taker: WeightsTaker, size: int, repeats: int, deadline: float) -> float | None:
        """Shortest seconds from sending a probe of `size` bytes to its echo."""
        payload = {"probe": np.zeros(size, np.uint8)} if size else None
        times = []
        for n in range(repeats):
            started = time.perf_counter()
            self.link.send_multipart(encode(Probe(n, size).header(), payload), copy=False)
            if not self._await_echo(taker, n, deadline):
                return None
            times.append(time.perf_counter() - started)
        return min(times)

    def _await_echo(self, taker: WeightsTaker, n: int, deadline: float) -> bool:
        while (left := deadline - time.perf_counter()) > 0:
            if not self.link.poll(max(1, int(left * 1000))):
                continue
            message = self._checked(self.link.recv_multipart(copy=False))
            if message is None:
                continue
            if isinstance(message[0], Probe):
                if message[0].n == n:
                    return True
            else:
                self._take(*message, taker)
        return False

    def _take(self, message: Message, arrays: dict[str, Any], taker: WeightsTaker) -> None:
        if isinstance(message, Weights):
            new_epoch = message.epoch != self.epoch
            if new_epoch:
                self.epoch = message.epoch
                self.credits.clear()
            if message.resync:
                self._resyncing = False
            taker.set_weights(message.version, arrays, force=new_epoch)
            self._waiting_since = None
        elif isinstance(message, Credit) and message.epoch == self.epoch and not self._resyncing:
            self.credits.append((message.slot, message.min_version, arrays if message.exact else None))
            self.sent.discard(message.slot)

    def newest_weights(self, taker: WeightsTaker) -> None:
        message = self._checked(newest(self.weights))
        if message is not None and isinstance(message[0], Weights) and message[0].epoch == self.epoch:
            taker.set_weights(message[0].version, message[1])
            self._waiting_since = None

    def _checked(self, frames: list[Any] | None) -> tuple[Message, dict[str, Any]] | None:
        """Decode and check a message from the learner; None (logged, counted) when malformed."""
        if frames is None:
            return None
        try:
            header, arrays = decode(frames)
            return parse(header, TO_ACTOR), arrays
        except WireError as exc:
            self.bad_messages += 1
            log_rejected(self.role, self.bad_messages, exc)
            return None


class SlotSender:
    """Fragments to a learner on the same machine: the actor writes rows straight into its
    shared-memory slot (`views`), and only a small notice travels on the link (move indices, not data)."""

    def __init__(self, path: Path, slots: int):
        self.writer = SlotWriter(path, slots)
        self._lent: dict[int, Any] = {}

    def views(self, slot: int) -> dict[str, Any] | None:
        """Where to write the next fragment for `slot` (None until a first fragment fixed the layout)."""
        views = self.writer.views(slot)
        if views is not None:
            self._lent[slot] = views
        return views

    def send(self, link: zmq.Socket[Any], notice: FragmentNotice, arrays: dict[str, Any]) -> None:
        if arrays is self._lent.pop(notice.slot, None):  # already in place
            location = self.writer.header(notice.slot)
        else:
            location = self.writer.write(notice.slot, arrays)
        link.send(pack_header(replace(notice, location=location).header()))

    def close(self) -> None:
        self.writer.close()


class FrameSender:
    """Fragments to a learner on another machine: the arrays ride as raw frames after the notice,
    sent without copies; `slot` still names the credit they use."""

    def views(self, slot: int) -> None:
        return None  # every fragment has arrays of its own, which the frames borrow until sent

    def send(self, link: zmq.Socket[Any], notice: FragmentNotice, arrays: dict[str, Any]) -> None:
        link.send_multipart(encode(notice.header(), arrays), copy=False)

    def close(self) -> None:
        pass
