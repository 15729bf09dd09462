"""The driver's side of the control link: orders to every role, and a heartbeat they watch."""

from __future__ import annotations

import secrets
import threading

import zmq

from tianji.runtime.shared.protocol import Heartbeat
from tianji.runtime.transport.security import CurveKeys
from tianji.runtime.transport.sockets import bound_endpoint, socket
from tianji.runtime.transport.wire import pack_header

HEARTBEAT_INTERVAL_S = 0.5  # the driver's heartbeat on the control socket


class ControlChannel:
    """The driver's side of the control socket (PUB): orders from the driver's loop, and a heartbeat
    every HEARTBEAT_INTERVAL_S from a thread of its own, so roles hear the driver even while its loop
    is busy (a slow Ray call, a checkpoint); they exit only when the driver process is gone.

        control = ControlChannel(ctx, endpoints.control, keys)
        control.send(pack_header(Stop().header()))
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: CurveKeys | None = None):
        inbox = f"inproc://tianji-control-{secrets.token_hex(4)}"
        self._orders = ctx.socket(zmq.PAIR)
        self._orders.bind(inbox)
        self._thread = threading.Thread(
            target=self._forward, args=(ctx, endpoint, keys, inbox), name="tianji-control", daemon=True
        )
        self._thread.start()
        self.endpoint = self._orders.recv().decode()  # the bound address (port `*` resolved), or an error
        if self.endpoint.startswith("error: "):
            raise zmq.ZMQError(msg=self.endpoint)

    def send(self, message: bytes) -> None:
        self._orders.send(message)

    def close(self) -> None:
        self._orders.send(b"")  # the end
        self._thread.join(5)
        self._orders.close(linger=0)

    @staticmethod
    def _forward(ctx: zmq.Context, endpoint: str, keys: CurveKeys | None, inbox: str) -> None:
        orders = ctx.socket(zmq.PAIR)
        orders.connect(inbox)
        try:
            publisher = socket(ctx, zmq.PUB, endpoint, bind=True, keys=keys)
        except zmq.ZMQError as exc:
            orders.send(f"error: {endpoint}: {exc}".encode())
            orders.close(linger=0)
            return
        orders.send(bound_endpoint(publisher).encode())
        heartbeat = pack_header(Heartbeat().header())
        try:
            while True:
                if orders.poll(int(HEARTBEAT_INTERVAL_S * 1000)):
                    message = orders.recv()
                    if not message:
                        return
                    publisher.send(message)
                publisher.send(heartbeat)
        finally:
            publisher.close(linger=0)
            orders.close(linger=0)
