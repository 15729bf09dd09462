"""A TCP proxy a test controls: it forwards connections to a target and can cut every link for a while.

proxy = TcpProxy("tcp://127.0.0.1:5555")   # listens on a free loopback port
proxy.endpoint                             # "tcp://127.0.0.1:PORT": connect here instead of the target
proxy.cut()                                # close every connection and refuse new ones
proxy.restore()                            # accept again (the same port)
proxy.bytes_forwarded                      # both ways, since the last restore (or the start)
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.bytes_forwarded = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(16)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return listener

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was closed: a cut
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
                with self._lock:
                    self.bytes_forwarded += len(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Every link through the proxy goes down at once; new ones are refused until `restore`."""
        self._listener.close()
        with self._lock:
            links, self._open = self._open, []
        for s in links:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        with self._lock:
            self.bytes_forwarded = 0
        self._listener = self._listen(self.port)
