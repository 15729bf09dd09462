"""The driver's side of a run, the same under every launcher that starts roles as processes:
aggregate role events, check stop conditions, replace dead or silent roles, stop everything.
It never touches sample data.

A launcher provides the roles (`Roles`): where they run and how they start is its business.
"""

from __future__ import annotations

import signal
import time
from typing import Protocol

import zmq

from tianji.runtime.driver.control import ControlChannel
from tianji.runtime.driver.keeper import CheckpointKeeper
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.events import Event, checked_event
from tianji.runtime.shared.logs import log, log_rejected
from tianji.runtime.shared.protocol import LearnerRestarted, Stop
from tianji.runtime.transport.wire import WireError, pack_header, unpack_header

STOP_GRACE_S = 20.0


def is_learner(name: str) -> bool:
    return name.startswith("learner")


class RoleError(RuntimeError):
    """A role failed in a way the driver cannot repair."""


class Roles(Protocol):
    """The role processes of a run, as a launcher placed them."""

    learner_epoch: int  # incarnation of the learner group: 0, then +1 per restart

    def names(self) -> list[str]:
        """'learner0', ..., 'actor0', ..., 'evaluator'."""

    def alive(self, name: str) -> bool: ...

    def exitcode(self, name: str) -> int | str | None: ...

    def restart(self, name: str) -> None:
        """Kill an actor or the evaluator if it still runs and start a new one."""

    def restart_learners(self) -> None:
        """Kill every learner and start the group anew (next epoch, from the last checkpoint):
        learners fail together, as a collective group must."""

    def learner_endpoints(self) -> list[dict[str, str]]:
        """Where each learner listens, when a restart may have moved them ([] when it cannot)."""

    def stop_all(self) -> None:
        """Make sure every role is gone (after they were asked to stop)."""


class _Supervisor:
    def __init__(self, run: RunContext, monitor: Monitor, events: zmq.Socket, control: ControlChannel, roles: Roles):
        self.run, self.monitor, self.events, self.control, self.roles = run, monitor, events, control, roles
        self.keeper = CheckpointKeeper(run, monitor)
        self.started = time.time()
        self.last_seen: dict[str, float] = {}  # role -> time of its last event
        self.rejected = 0

    def drain_events(self, timeout_ms: int) -> None:
        if not self.events.poll(timeout_ms):
            return
        while self.events.poll(0):
            frames = self.events.recv_multipart()
            try:
                event = checked_event(unpack_header(frames[0]))
            except WireError as exc:
                self.rejected += 1
                self.monitor.count("bad_messages")
                log_rejected("driver", self.rejected, exc)
                continue
            self._handle(event, frames[1:])

    def _handle(self, event: Event, payload: list[bytes]) -> None:
        role = event.get("role")
        if isinstance(role, str):
            self.last_seen[role] = time.time()
        kind = event["kind"]
        if kind == "checkpoint":
            self.keeper.on_notice(dict(event), payload)
        elif kind == "error":
            log.error("%s failed:\n%s", role, event.get("message"))
        else:
            self.monitor.on_event(event)

    def check_roles(self) -> None:
        limits = self.run.cfg.supervision
        now = time.time()
        for name in self.roles.names():
            silent_s = now - self.last_seen.get(name, self.started)
            if self.roles.alive(name) and silent_s < limits.heartbeat_timeout_s:
                continue
            if self.roles.alive(name):
                log.warning("%s sent no event for %.0f s; replacing it", name, silent_s)
            else:
                log.warning("%s exited with code %s; restarting it", name, self.roles.exitcode(name))
            if is_learner(name):
                self._count("learner_restarts", limits.max_learner_restarts, name)
                self.roles.restart_learners()
                self.last_seen.update({n: time.time() for n in self.roles.names() if is_learner(n)})
                # actors and evaluator say hello to the new learners (where they now listen)
                restarted = LearnerRestarted(self.roles.learner_epoch, tuple(self.roles.learner_endpoints()))
                self.control.send(pack_header(restarted.header()))
                return  # the other learners were replaced too
            self._count("role_restarts", limits.max_actor_restarts, name)
            self.roles.restart(name)
            self.last_seen[name] = time.time()

    def _count(self, counter: str, limit: int, name: str) -> None:
        if self.monitor.count(counter) > limit:
            raise RoleError(
                f"{name} failed and {counter.replace('_', ' ')} reached supervision limit {limit}; "
                f"last exit code {self.roles.exitcode(name)}"
            )

    def supervise(self) -> str:
        while True:
            self.drain_events(timeout_ms=50)
            self.monitor.tick()
            reason = self.monitor.stop_reason()
            if reason is not None:
                return reason
            self.check_roles()

    def shutdown(self) -> None:
        """Ask every role to stop (the learner writes its final checkpoint), then make sure they are gone."""
        deadline = time.time() + STOP_GRACE_S
        while time.time() < deadline and any(self.roles.alive(name) for name in self.roles.names()):
            self.control.send(pack_header(Stop().header()))
            self.drain_events(timeout_ms=100)
        self.roles.stop_all()
        self.drain_events(timeout_ms=0)


def drive(run: RunContext, monitor: Monitor, events: zmq.Socket, control: ControlChannel, roles: Roles) -> str:
    """Supervise the roles until a stop condition (or Ctrl-C), then stop them; returns the stop reason."""
    supervisor = _Supervisor(run, monitor, events, control, roles)
    try:
        return supervisor.supervise()
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is bounded; let it finish
        try:
            supervisor.shutdown()
        finally:
            signal.signal(signal.SIGINT, previous)
