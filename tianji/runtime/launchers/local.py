"""Local launcher: the learner, A actors and the evaluator as processes on this machine.

Roles are forked from the driver (fast start; the driver runs no torch ops before forking) and
die with it. Their loops live in `tianji.runtime.roles.loops`, the supervision in
`tianji.runtime.driver.supervise`; this module only starts, restarts and ends processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket as pysocket
from collections.abc import Callable
from functools import partial
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from tianji.runtime.driver.control import ControlChannel
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.driver.supervise import drive, is_learner
from tianji.runtime.process.life import new_token, sweep_leftovers
from tianji.runtime.roles.loops import actor_main, evaluator_main, learner_main, role_pool
from tianji.runtime.roles.service import learner_of
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.logs import log
from tianji.runtime.sync import GroupSpec
from tianji.runtime.transport.shm import remove_pools
from tianji.runtime.transport.sockets import Endpoints, socket


def run_local(run: RunContext, monitor: Monitor) -> str:
    """Start the learners, actors and evaluator, supervise them until a stop condition, stop them cleanly."""
    removed = sweep_leftovers()
    if removed:
        log.info("removed %d leftover ipc socket(s) and slot file(s) of runs that died", len(removed))
    token = new_token()
    endpoints = [Endpoints.ipc(token, rank) for rank in range(run.cfg.topology.learner_count)]
    ctx = zmq.Context()
    control = None
    try:
        events = socket(ctx, zmq.PULL, endpoints[0].events, bind=True)
        control = ControlChannel(ctx, endpoints[0].control)
        roles = LocalRoles(run, endpoints, token)
        return drive(run, monitor, events, control, roles)
    finally:
        if control is not None:
            control.close()
        ctx.destroy(linger=0)
        remove_pools(token)
        for path in {p for e in endpoints for p in e.ipc_paths()}:
            path.unlink(missing_ok=True)


def free_loopback_port() -> int:
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRoles:
    """Role processes forked from the driver, each known by name."""

    def __init__(self, run: RunContext, endpoints: list[Endpoints], token: str):
        self.run, self.endpoints, self.token = run, endpoints, token
        self.learner_epoch = 0
        self._mp = multiprocessing.get_context("fork")
        cfg = run.cfg
        learners = len(endpoints)
        self._group_port = free_loopback_port()
        # name -> (process body, its arguments after (run, endpoints, token, driver pid), read at each start)
        self._targets: dict[str, tuple[Callable[..., None], Callable[[], tuple[Any, ...]]]] = {}
        for rank in range(learners):
            self._targets[f"learner{rank}"] = (learner_main, partial(self._learner_args, rank))
        for i in range(cfg.topology.actor_count):
            self._targets[f"actor{i}"] = (actor_main, partial(self._actor_args, i))
        if cfg.eval.interval_s is not None:
            self._targets["evaluator"] = (evaluator_main, lambda: (self.endpoints[0],))
        self.processes = {name: self._start(name) for name in self._targets}
        self._write_pids()

    def _learner_args(self, rank: int) -> tuple[Any, ...]:
        return self.endpoints[rank], self.learner_epoch, rank, self._group(rank)

    def _actor_args(self, actor_id: int) -> tuple[Any, ...]:
        return self.endpoints[learner_of(self.run.cfg, actor_id)], actor_id

    def _group(self, rank: int) -> GroupSpec | None:
        learners = len(self.endpoints)
        if learners == 1:
            return None
        return GroupSpec(rank, learners, "127.0.0.1", self._group_port, self.run.cfg.sync.timeout_s)

    def names(self) -> list[str]:
        return list(self.processes)

    def alive(self, name: str) -> bool:
        return self.processes[name].is_alive()

    def exitcode(self, name: str) -> int | None:
        return self.processes[name].exitcode

    def restart(self, name: str) -> None:
        old = self._end(name)
        if old.pid is not None:
            role_pool(self.token, name, old.pid).unlink(missing_ok=True)  # the dead actor's slots
        self.processes[name] = self._start(name)
        self._write_pids()

    def restart_learners(self) -> None:
        learners = [name for name in self.processes if is_learner(name)]
        for name in learners:
            self._end(name)
        self.learner_epoch += 1
        self._group_port = free_loopback_port()  # a fresh rendezvous for the new group
        for name in learners:
            self.processes[name] = self._start(name)
        self._write_pids()

    def learner_endpoints(self) -> list[dict[str, str]]:
        return []  # ipc paths do not move

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                log.warning("%s did not stop in time; terminating it", process.name)
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
            process.join(1)

    def _end(self, name: str) -> BaseProcess:
        process = self.processes[name]
        if process.is_alive():
            process.kill()
        process.join(5)
        return process

    def _start(self, name: str) -> BaseProcess:
        target, args = self._targets[name]
        endpoints, *rest = args()
        process = self._mp.Process(
            target=target, args=(self.run, endpoints, self.token, os.getpid(), *rest), name=name, daemon=True
        )
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # children inherit "ignore Ctrl-C"
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        return process

    def _write_pids(self) -> None:
        """roles.json: which process is which, for operators (and the fault-tolerance tests)."""
        pids = {name: p.pid for name, p in self.processes.items()}
        (self.run.run_dir / "roles.json").write_text(json.dumps(pids))
