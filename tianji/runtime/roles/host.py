"""A node host: starts a machine's role processes from one warm zygote, so the machine imports the
role code (torch, the envs) once rather than once per role.

    host = NodeHost(["tianji.runtime.launchers.ray"])   # the zygote starts importing at once
    pid = host.start("actor0", "tianji.runtime.launchers.ray:role_process", spec)
    host.exitcodes()                                     # {"actor0": (pid, None)} while it runs

The zygote is a fresh interpreter (`python -m tianji.runtime.roles.host`) that imports the named
modules, then forks one child per request; a child runs `module:function(spec)` and exits. Forking
from this single-threaded zygote rather than from the host keeps children clear of whatever threads
the host's own process runs (a Ray worker runs many). Requests and replies are JSON lines on two
pipes; every process dies with its parent (the zygote with the host, a role with the zygote).

This module imports no torch, so a launcher can create a host before its own heavy imports finish.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket as pysocket
import subprocess
import sys
import tempfile
import traceback
from typing import Any

from tianji.runtime.transport.links import die_with_parent

READY = "ready"


class HostError(RuntimeError):
    """The zygote could not load the role code or start a role."""


class NodeHost:
    """Role processes of one machine, known by name, forked from a zygote that `preload` warms."""

    def __init__(self, preload: list[str]):
        replies_r, replies_w = os.pipe()
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "tianji.runtime.roles.host", str(replies_w), str(os.getpid()), *preload],
            stdin=subprocess.PIPE, pass_fds=(replies_w,), text=True)
        os.close(replies_w)
        self._replies = os.fdopen(replies_r, "r")
        self._ready = False
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
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for name in list(self._roles):
            self.kill(name)
        if self._zygote.poll() is None:
            self._zygote.kill()
        self._zygote.wait()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self._ready:
            self._ready = self._reply()[READY]
        assert self._zygote.stdin is not None
        self._zygote.stdin.write(json.dumps(request) + "\n")
        self._zygote.stdin.flush()
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            raise HostError(f"the zygote exited (code {self._zygote.wait()}); its log says why")
        reply = json.loads(line)
        if "error" in reply:
            raise HostError(reply["error"])
        return reply


# ---------------------------------------------------------------- the zygote's side


def _child(target: str, spec: dict[str, Any], replies: int) -> int:
    """In a forked child: leave the zygote's pipes alone, run the role, return its exit code."""
    os.close(replies)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    module, function = target.split(":")
    try:
        getattr(importlib.import_module(module), function)(spec)  # preloaded: a dict lookup
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:  # os._exit follows: nothing else flushes
        sys.stdout.flush()
        sys.stderr.flush()


def _reap() -> dict[int, int]:
    exits = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exits
        if pid == 0:
            return exits
        exits[pid] = os.waitstatus_to_exitcode(status)


def zygote_main(replies: int, host_pid: int, preload: list[str]) -> None:
    die_with_parent(host_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(replies, "w", buffering=1)
    try:
        for module in preload:
            importlib.import_module(module)
        out.write(json.dumps({READY: True}) + "\n")
    except BaseException:
        out.write(json.dumps({"error": f"the role code did not load:\n{traceback.format_exc()}"}) + "\n")
        return
    for line in sys.stdin:  # EOF: the host closed us
        request = json.loads(line)
        if request.get("op") == "reap":
            out.write(json.dumps({"exits": _reap()}) + "\n")
            continue
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request["target"], request["spec"], replies))
        out.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    zygote_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
