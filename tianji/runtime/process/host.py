"""A node host: starts a machine's role processes from one warm zygote, so the machine imports the
role code (torch, the envs) once rather than once per role.

    host = NodeHost(["tianji.runtime.launchers.ray"])   # the zygote starts importing at once
    pid = host.start("actor0", "tianji.runtime.launchers.ray:role_process", spec)
    host.exitcodes()                                     # {"actor0": (pid, None)} while it runs

The zygote is a fresh interpreter (`python -m tianji.runtime.process.host`) that imports the named
modules, then forks one child per request; a child runs `module:function(spec)` and exits. Forking
from this single-threaded zygote rather than from the host keeps children clear of whatever threads
the host's own process runs (a Ray worker runs many). The zygote listens on a Unix socket in a
private folder for the one host that drives it (JSON lines), so the process that starts it need not
be the host: a command can start the zygote of its own machine before Ray is even up and hand it
to the host Ray creates there (`Zygote`). A zygote exits when its host goes (end of the connection)
or its parent does; a role dies with its zygote.

This module imports no torch, so a launcher can create a host before its own heavy imports finish.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket as pysocket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from tianji.runtime.process.life import die_with_parent

READY = "ready"
CONNECT_TIMEOUT_S = 60.0
FOLDER_PREFIX = "tianji-zygote-"


class HostError(RuntimeError):
    """The zygote could not load the role code or start a role."""


class Zygote:
    """A zygote started by this process; a NodeHost drives it through `path` (here or in a process
    this one hands the path to)."""

    def __init__(self, preload: list[str]):
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))  # mode 0700: this user only
        self.path = str(self.folder / "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tianji.runtime.process.host", self.path, str(os.getpid()), *preload],
            stdin=subprocess.DEVNULL,
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class NodeHost:
    """Role processes of one machine, known by name, forked from a zygote that `preload` warms: one it
    starts itself, or the one listening at `zygote_path` (started by another process of this machine)."""

    def __init__(self, preload: list[str], zygote_path: str | None = None):
        self._own = Zygote(preload) if zygote_path is None else None
        self._path = zygote_path or self._own.path  # type: ignore[union-attr]
        self._channel: Any = None  # connected at the first request; the zygote loads meanwhile
        self._roles: dict[str, int] = {}  # name -> pid of its current process
        self._exits: dict[int, int] = {}  # pid -> exit code, once reaped

    def start(self, name: str, target: str, spec: dict[str, Any], attachment: bytes | None = None) -> int:
        """Fork a process that runs `target` ("module:function") with `spec` (JSON-able); its pid. An
        attachment (bytes, e.g. a checkpoint) is handed over as a file: `spec["attachment"]` is its path."""
        self.kill(name)
        if attachment is not None:
            with tempfile.NamedTemporaryFile(prefix=f"tianji-{name}-", delete=False) as file:
                file.write(attachment)
            spec = {**spec, "attachment": file.name}
        pid = int(self._ask({"target": target, "spec": spec})["pid"])
        self._roles[name] = pid
        return pid

    def exitcodes(self) -> dict[str, tuple[int, int | None]]:
        """name -> (pid, exit code or None while it runs); a killed process has a negative code."""
        self._exits.update({int(pid): code for pid, code in self._ask({"op": "reap"})["exits"].items()})
        return {name: (pid, self._exits.get(pid)) for name, pid in self._roles.items()}

    @staticmethod
    def free_ports(address: str, count: int) -> list[int]:
        """`count` distinct TCP ports free on `address` now (held together while chosen)."""
        probes = [pysocket.socket() for _ in range(count)]
        try:
            for probe in probes:
                probe.bind((address, 0))
            return [probe.getsockname()[1] for probe in probes]
        finally:
            for probe in probes:
                probe.close()

    def kill(self, name: str) -> None:
        pid = self._roles.pop(name, None)
        if pid is not None and pid not in self._exits:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for name in list(self._roles):
            self.kill(name)
        if self._channel is not None:
            self._channel.close()  # the zygote sees the end of its connection and exits
        if self._own is not None:
            self._own.close()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._channel is None:
            self._channel = self._connect()
            self._reply()  # READY: the role code has loaded
        self._channel.write(json.dumps(request) + "\n")
        self._channel.flush()
        return self._reply()

    def _connect(self) -> Any:
        deadline = time.time() + CONNECT_TIMEOUT_S
        while True:
            sock = pysocket.socket(pysocket.AF_UNIX)
            try:
                sock.connect(self._path)
                return sock.makefile("rw", buffering=1)
            except (FileNotFoundError, ConnectionRefusedError):  # not listening yet
                sock.close()
                if time.time() > deadline or (self._own is not None and self._own.process.poll() is not None):
                    raise HostError(f"no zygote listens at {self._path}; its log says why") from None
                time.sleep(0.01)

    def _reply(self) -> dict[str, Any]:
        line = self._channel.readline()
        if not line:
            raise HostError("the zygote exited; its log says why")
        reply = json.loads(line)
        if "error" in reply:
            raise HostError(reply["error"])
        return reply


# ---------------------------------------------------------------- the zygote's side


def _child(target: str, spec: dict[str, Any]) -> int:
    """In a forked child: run the role, return its exit code."""
    module, function = target.split(":")
    try:
        getattr(importlib.import_module(module), function)(spec)  # preloaded: a dict lookup
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _reap() -> dict[int, int]:
    exits: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exits
        if pid == 0:
            return exits
        exits[pid] = os.waitstatus_to_exitcode(status)


def _load(preload: list[str]) -> dict[str, Any]:
    try:
        for module in preload:
            importlib.import_module(module)
        return {READY: True}
    except BaseException:
        return {"error": f"the role code did not load:\n{traceback.format_exc()}"}


def zygote_main(path: str, parent_pid: int, preload: list[str]) -> int:
    """Serve the host until it goes; returns the exit code: the zygote's (0), or in a forked child
    the role's, which leaves the request loop and ends as a process of its own would."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = pysocket.socket(pysocket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)  # a host may connect now; it waits for READY
    loaded = _load(preload)
    connection, _ = listener.accept()
    listener.close()
    Path(path).unlink(missing_ok=True)
    if Path(path).parent.name.startswith(FOLDER_PREFIX):  # nobody else will connect: leave no folder behind
        Path(path).parent.rmdir()
    channel = connection.makefile("rw", buffering=1)
    channel.write(json.dumps(loaded) + "\n")
    if READY not in loaded:
        return 0
    for line in channel:  # the end: the host closed the connection or died
        request = json.loads(line)
        if request.get("op") == "reap":
            channel.write(json.dumps({"exits": _reap()}) + "\n")
            continue
        pid = os.fork()
        if pid == 0:  # the child leaves the loop (nothing of the zygote's is left to clean up: the socket
            # file is gone, and closing its copy of the connection leaves the zygote's open)
            channel.close()
            connection.close()
            return _child(request["target"], request["spec"])
        channel.write(json.dumps({"pid": pid}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(zygote_main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
