"""Measurement for the planner (`tianji.tools.plan`): what one learner, one actor per envs-per-actor
value, the cores and a learner group of two do on this machine.

    space = Space(envs=[16, 32], actors=[1, 2], fragment_steps=2048, preferred_envs=32, learners=(1, 2))
    calibration = calibrate(cfg, space)     # ~10-30 s, in this process (the planner runs it in a child)

Every rate is measured where a run would see it: the learner first (after the actors' envs, ALE's
above all, it trained 15-20 % slower than in a fresh process), every core busy at once against one
alone, two learners training as an allreduce group (a collective's real cost), and the actors last.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from tianji.config import Config, build_config
from tianji.runtime.launchers.local import free_loopback_port
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.runtime.sync import GroupSpec, join_group, leave_group, make_sync, measure_group
from tianji.runtime.transport.links import die_with_parent

SYNC_LATENCY_S = 100e-6  # one message of a gloo collective between learners, until measured
SYNC_BANDWIDTH = 1e9  # bytes/s between learners, until measured


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured (cached as JSON per machine and config by the planner)."""

    actor_rates: dict[int, float]  # envs per actor -> env steps/s of one actor on one core
    learner_rate: float  # env steps/s one learner consumes on one core
    steps_per_update: float  # env steps consumed per learner update
    fragment_steps: int  # envs x steps per fragment (kept for every layout)
    seconds: float
    optimizer_steps_per_update: float = 1.0  # gradient steps in one update (one collective each under allreduce)
    parameters: int = 0  # trained parameters (what a learner group keeps in step)
    # a learner group's collectives: measured by a group of two on this machine when learners are planned
    sync_latency_s: float = SYNC_LATENCY_S  # one message: half an all_reduce of one number between two
    sync_bytes_per_s: float = SYNC_BANDWIDTH  # bus bandwidth of an all_reduce of the model's gradients
    sync_measured: bool = False
    # every core busy at once runs each at this fraction of a lone core's speed (shared caches, memory,
    # SMT siblings): the learner's update loop on all cores at once vs alone; 1.0 until measured
    core_efficiency: float = 1.0
    # each of two learners training as an allreduce group on this machine (a core each); 0: not measured
    group_learner_rate: float = 0.0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Space:
    """The layouts to consider: envs-per-actor values, actor counts, and the fragment size kept for all."""

    envs: list[int]
    actors: list[int]
    fragment_steps: int
    preferred_envs: int
    learners: tuple[int, ...] = (1,)


def with_layout(cfg: Config, actors: int, envs: int, fragment_steps: int, learners: int | None = None) -> Config:
    raw = cfg.model_dump(mode="json")
    raw["topology"].update(actors=actors, envs_per_actor=envs, fragment_length=max(1, fragment_steps // envs))
    if learners is not None:
        raw["topology"]["learners"] = learners
    elif raw["topology"]["learners"] == "auto":
        raw["topology"]["learners"] = 1
    return build_config(raw)


def calibrate(cfg: Config, space: Space, seconds_per_actor: float = 1.0, learner_seconds: float = 2.5,
              group: bool = False) -> Calibration:
    """Measure one actor per envs-per-actor value and one learner, each on one core, in this process;
    and a learner group of two when the space plans learners or `group` asks (a cluster what-if)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    # the learner first: measured after the actors' envs (ALE's above all) it ran 15-20 % slower than in
    # a fresh process, as it does in a run
    layout = with_layout(cfg, 1, space.preferred_envs, space.fragment_steps)
    learner_rate, steps_per_update, gradient_steps, parameters = _learner_rate(layout, build_actor, build_learner,
                                                                               learner_seconds)
    efficiency = measure_core_efficiency(layout, available_cores(), build_actor, build_learner)
    sync = {}
    if group or max(space.learners) > 1:
        costs = measure_local_group(parameters)
        sync = {"sync_latency_s": costs["allreduce_latency_s"] / 2,  # a ring of two: two messages
                "sync_bytes_per_s": costs["allreduce_bytes_per_s"], "sync_measured": True}
        if available_cores() >= 2:  # what a step's collective really costs two training learners
            sync["group_learner_rate"] = measure_group_training(layout, learner_rate / steps_per_update)
            sync["sync_latency_s"] = message_latency(sync["group_learner_rate"], learner_rate, steps_per_update,
                                                     gradient_steps, 4 * parameters / costs["allreduce_bytes_per_s"],
                                                     sync["sync_latency_s"])
    rates = {}
    for k in space.envs:
        actor = build_actor(with_layout(cfg, 1, k, space.fragment_steps), 0)
        actor.collect()  # warm-up: allocation, first inference
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds_per_actor:
            steps += actor.collect().env_steps
        rates[k] = steps / (time.perf_counter() - t0)
        actor.envs.close()
    return Calibration(rates, learner_rate, steps_per_update, space.fragment_steps, time.perf_counter() - started,
                       gradient_steps, parameters, core_efficiency=efficiency, **sync)


def measure_core_efficiency(layout: Config, cores: int, build_actor, build_learner, seconds: float = 2.0) -> float:
    """How fast each core runs while all are busy, as a fraction of one core alone: the learner's update
    loop in one process, then in `cores` processes that start together (after their warm-up) and time
    the same window; both measured the same way, in processes forked from this one."""
    if cores < 2:
        return 1.0
    lone = _rates_on_cores(layout, 1, seconds, build_actor, build_learner)
    together = _rates_on_cores(layout, cores, seconds, build_actor, build_learner)
    return min(1.0, sum(together) / len(together) / lone[0])


def _rates_on_cores(layout: Config, copies: int, seconds: float, build_actor, build_learner) -> list[float]:
    ctx = process_context()
    results = ctx.Queue()
    start = ctx.Barrier(copies)
    processes = [ctx.Process(target=_busy_core, args=(layout, seconds, start, results, os.getpid(), build_actor,
                                                      build_learner)) for _ in range(copies)]
    for process in processes:
        process.start()
    try:
        return [results.get(timeout=60) for _ in processes]
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()


def _busy_core(layout: Config, seconds: float, start: Any, results: Any, parent_pid: int, build_actor,
               build_learner) -> None:
    die_with_parent(parent_pid)
    torch.set_num_threads(1)
    results.put(_learner_rate(layout, build_actor, build_learner, seconds, start)[0])


def measure_group_training(layout: Config, updates_per_s: float, seconds: float = 2.0,
                           timeout_s: float = 60.0) -> float:
    """Env steps/s each of two learners consumes when they train as an allreduce group on this machine
    (gloo over loopback, a core each): every optimizer step's collective at its real cost, the long
    tail of its waits, the flattening and the slower of the two included."""
    updates = max(3, round(seconds * updates_per_s))  # the same count on both: neither is left waiting
    ctx = process_context()
    results = ctx.Queue()
    port = free_loopback_port()
    ranks = [ctx.Process(target=_group_learner, args=(layout, GroupSpec(rank, 2, "127.0.0.1", port, timeout_s),
                                                      updates, results, os.getpid())) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        rates = [results.get(timeout=timeout_s + 60) for _ in ranks]
    finally:
        for process in ranks:
            process.join(5)
            if process.is_alive():
                process.kill()
    return sum(rates) / len(rates)


def _group_learner(layout: Config, spec: GroupSpec, updates: int, results: Any, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    torch.set_num_threads(1)
    join_group(spec)
    try:
        results.put(_learner_rate(layout, build_actor, build_learner, 0.0, group_sync=make_sync("allreduce", 2),
                                  updates=updates)[0])
    finally:
        leave_group()


def message_latency(group_rate: float, learner_rate: float, steps_per_update: float, optimizer_steps: float,
                    bucket_s: float, probed: float) -> float:
    """One collective message's cost as two training learners pay it: what a step of theirs takes
    beyond a lone learner's, less the bucket's transfer, over the ring's two messages (never below
    what the probe measured)."""
    per_step = (steps_per_update / group_rate - steps_per_update / learner_rate) / max(optimizer_steps, 1.0)
    return max(probed, (per_step - bucket_s) / 2)


def measure_local_group(parameters: int, learners: int = 2, timeout_s: float = 60.0) -> dict[str, float]:
    """A learner group's collective costs on this machine: `learners` processes form a gloo group
    over loopback and run the probe every learner group runs at start (`measure_group`), with a
    bucket of the model's size."""
    ctx = process_context()
    results, sender = ctx.Pipe(duplex=False)
    port = free_loopback_port()
    ranks = [ctx.Process(target=_probe_rank, args=(GroupSpec(rank, learners, "127.0.0.1", port, timeout_s),
                                                   parameters, sender if rank == 0 else None, os.getpid()))
             for rank in range(learners)]
    for process in ranks:
        process.start()
    sender.close()
    try:
        if not results.poll(timeout_s):
            raise RuntimeError(f"the learner-group probe did not finish within {timeout_s:.0f} s")
        return results.recv()
    finally:
        for process in ranks:
            process.join(5)
            if process.is_alive():
                process.kill()


def _probe_rank(spec: GroupSpec, parameters: int, results: Any, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    join_group(spec)
    costs = measure_group(parameters)
    leave_group()
    if results is not None:
        results.send(costs)


class _CountingHook:
    """Stands where a learner group's gradient allreduce is: counts the optimizer steps (and passes
    them on to the group's sync when there is one)."""

    def __init__(self, group_sync: Any = None):
        self.calls = 0
        self.group_sync = group_sync

    def gradients(self, params: Any) -> None:
        self.calls += 1
        if self.group_sync is not None:
            self.group_sync.gradients(params)


def _learner_rate(layout: Config, build_actor, build_learner, seconds: float, start: Any = None,
                  group_sync: Any = None, updates: int | None = None) -> tuple[float, float, float, int]:
    """Env steps/s one learner consumes, fed as fast as its balance rules allow; env steps, optimizer
    steps per update, and the number of trained parameters. `start`: a barrier to time from, after
    the warm-up (several copies timing the same window). `group_sync`: the learner's group (then
    every member times the same number of `updates`, so none leaves another waiting in a collective)."""
    actor = build_actor(layout, 0)
    fragments = [actor.collect() for _ in range(4)]
    actor.envs.close()
    learner = build_learner(layout)
    hook = learner.algo.sync = _CountingHook(group_sync)
    fed = 0

    def feed_or_train() -> None:
        nonlocal fed
        if learner.wants_data():
            fragment = fragments[fed % len(fragments)]
            fragment.policy_version = learner.version  # calibration data is never stale
            learner.consume(fragment)
            fed += 1
        if learner.ready():
            learner.update()

    deadline = time.perf_counter() + 30
    while learner.updates < 2:  # warm-up (replay fill, first updates) is not timed
        if time.perf_counter() > deadline:
            raise RuntimeError("the learner did not become ready within 30 s of calibration data")
        feed_or_train()
    if start is not None:
        start.wait(60)
    fed_before, updates_before, t0 = fed, learner.updates, time.perf_counter()
    while (time.perf_counter() - t0 < seconds) if updates is None else (learner.updates - updates_before < updates):
        feed_or_train()
    steps = (fed - fed_before) * fragments[0].env_steps
    updates = max(1, learner.updates - updates_before)
    parameters = sum(p.numel() for p in learner.algo.parameters())
    return steps / (time.perf_counter() - t0), steps / updates, hook.calls / max(1, learner.updates), parameters


def process_context() -> Any:
    """fork (fast: nothing to import again), except from a process connected to Ray (a driver under
    --launcher ray): Ray's threads may hold a lock a forked child inherits and hangs on; spawn then."""
    ray = sys.modules.get("ray")
    connected = ray is not None and getattr(ray, "is_initialized", lambda: False)()
    return multiprocessing.get_context("spawn" if connected else "fork")
