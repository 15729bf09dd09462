"""Endpoints and sockets: where the run's links are and how they connect (the messages on them are the
roles' and the driver's business: tianji.runtime.roles.links, tianji.runtime.driver.control).

    actor/evaluator --DEALER--> learner ROUTER   hello {actor, slots}; fragment notices {slot, epoch, ...}
    actor/evaluator <--DEALER-- learner ROUTER   weights {version, epoch} (reply to hello);
                                                 credit {slot, min_version, epoch}
    actor          <-DEALER-> learner ROUTER   probe {n} + payload, echoed as probe {n} (a TCP link's rate)
    actor/evaluator <--SUB----- learner PUB      weights {version, epoch}, newest wins
    every role      --PUSH----> driver PULL      metric deltas (also heartbeats), checkpoint notices, errors
    every role      <--SUB----- driver PUB       stop, heartbeat, learner_restarted {epoch}

Sample data travels in frames only to a learner on another machine; there an actor first measures
its link (`LearnerLink.measure`). A learner's `epoch` is its incarnation: the driver restarts a dead learner with
the next epoch, and everything stamped with an older one (credits, notices, weights) is ignored.
On one machine notices name shared-memory slots instead (see tianji.runtime.transport.shm).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from tianji.runtime.transport.security import CurveKeys, join, serve


@dataclass(frozen=True)
class Endpoints:
    """Where a run's roles meet. ipc paths on one machine; TCP addresses (with the run's CURVE
    keys) across machines, the learner's filled in once it has bound."""

    fragments: str
    weights: str
    events: str
    control: str
    keys: CurveKeys | None = None

    @classmethod
    def ipc(cls, token: str, learner: int = 0) -> Endpoints:
        """One machine: the run's ipc paths, with those of learner `learner` (each learner has its own)."""
        base = f"ipc://{tempfile.gettempdir()}/tianji-{token}"
        return cls(f"{base}-fragments{learner}", f"{base}-weights{learner}", f"{base}-events", f"{base}-control")

    def ipc_paths(self) -> list[Path]:
        return [
            Path(e[len("ipc://") :])
            for e in (self.fragments, self.weights, self.events, self.control)
            if e.startswith("ipc://")
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "fragments": self.fragments,
            "weights": self.weights,
            "events": self.events,
            "control": self.control,
            "keys": None if self.keys is None else self.keys.as_dict(),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Endpoints:
        keys = raw.get("keys")
        return cls(
            raw["fragments"], raw["weights"], raw["events"], raw["control"], None if keys is None else CurveKeys(**keys)
        )


HEARTBEAT_IVL_MS = 1000  # a TCP link's ZMTP heartbeat: a link cut without a word (a dead switch, a
HEARTBEAT_TIMEOUT_MS = 4000  # blackholed route) is noticed and reconnected within a few seconds


def socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    bind: bool = False,
    keys: CurveKeys | None = None,
    identity: bytes | None = None,
) -> zmq.Socket:
    """A socket bound or connected to `endpoint`; every TCP one is CURVE-secured with the run's keys and
    sends heartbeats, so a dead link is noticed and reconnected. Binding to port `*` picks a free port:
    `sock.last_endpoint` says which. `identity`: a connecting socket's routing id, kept across reconnects
    (a ROUTER with handover then knows the peer again after a cut link)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)  # never hang on exit if the peer is gone
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer that reconnects with its identity takes it over
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if endpoint.startswith("tcp://"):
        if keys is None:
            raise ValueError(f"{endpoint}: TCP sockets need the run's CURVE keys")
        (serve if bind else join)(sock, keys)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def newest(sock: zmq.Socket) -> list[Any] | None:
    """Drain a SUB socket and keep the newest message (newest weights win)."""
    message = None
    while sock.poll(0):
        message = sock.recv_multipart(copy=False)
    return message
