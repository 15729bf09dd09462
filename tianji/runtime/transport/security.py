"""Authenticated, encrypted TCP links: ZeroMQ CURVE with keys made per run, and a ZAP gatekeeper.

The driver makes one server key pair (every listener of the run uses it) and one client key pair
(every role connects with it) and hands them to the roles through the launcher. A process that
listens on TCP runs a `Gatekeeper`: a peer that does not present the run's client key is refused
during the handshake, before any of its messages reach a socket, and counted.

    keys = CurveKeys.new()
    gate = Gatekeeper(ctx, keys)            # in each listening process
    serve(sock, keys); sock.bind(...)       # listener
    join(sock, keys); sock.connect(...)     # client
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import zmq

log = logging.getLogger("tianji")


class SecurityUnavailable(RuntimeError):
    """This libzmq was built without CURVE (libsodium)."""


@dataclass(frozen=True)
class CurveKeys:
    server_public: str  # Z85 text: travels as plain strings through launchers, never pickled objects
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def new(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise SecurityUnavailable(
                "this pyzmq/libzmq has no CURVE support; install a pyzmq wheel (it bundles "
                "libsodium) to run across machines"
            )
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def serve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (call before bind)."""
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_server = True


def join(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of the run's listeners (call before connect)."""
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()


class Gatekeeper:
    """The ZAP handler of one process: admits the run's client key, refuses and counts every other."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys):
        from zmq.auth.thread import ThreadAuthenticator

        self.allowed = keys.client_public.encode()
        self.refused = 0
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("tianji.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:  # called by the authenticator thread
        if key == self.allowed:
            return True
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused a peer without the run's key (%d so far)", self.refused)
        return False

    def stop(self) -> None:
        self._auth.stop()
