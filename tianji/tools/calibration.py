"""Measurement for the planner (`tianji.tools.plan`): what one learner, one actor per envs-per-actor
value, the cores and a learner group of two do on this machine.

    space = Space(envs=[16, 32], actors=[1, 2], fragment_steps=2048, preferred_envs=32, learners=(1, 2))
    calibration = calibrate(cfg, space)     # ~10-30 s (the planner runs it in a child process)

Every rate is measured where a run would see it: the learner first (after the actors' envs, ALE's
above all, it trained 15-20 % slower than in a fresh process), every core busy at once against one
alone, two learners training as an allreduce group (a collective's real cost), and the actors last.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tianji.config import Config, build_config
from tianji.runtime.launchers.local import free_loopback_port
from tianji.runtime.process.life import die_with_parent
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.runtime.sync import GroupSpec, join_group, leave_group, make_sync, probe_group

SYNC_LATENCY_S = 100e-6  # one message of a gloo collective between learners, until measured
SYNC_BANDWIDTH = 1e9  # bytes/s between learners, until measured
MAX_COPIES = 16  # the core-efficiency measurement runs at most this many learners at once


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
    sync_latency_s: float = SYNC_LATENCY_S  # one message, as two learners training as a group pay it
    sync_bytes_per_s: float = SYNC_BANDWIDTH  # bus bandwidth of an all_reduce (a probe of at least 1 MiB)
    sync_measured: bool = False
    probe_latency_s: float = SYNC_LATENCY_S  # one message of the probe: half an all_reduce of one number
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


def calibrate(
    cfg: Config, space: Space, seconds_per_actor: float = 1.0, learner_seconds: float = 2.5, group: bool = False
) -> Calibration:
    """Measure one learner and one actor per envs-per-actor value, each on one core, in this process;
    the cores all busy at once, and a learner group of two when the space plans learners or `group`
    asks (a cluster what-if), in processes forked from it."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    # the learner first: measured after the actors' envs (ALE's above all) it ran 15-20 % slower than in
    # a fresh process, as it does in a run
    layout = with_layout(cfg, 1, space.preferred_envs, space.fragment_steps)
    learner_rate, steps_per_update, gradient_steps, parameters = _learner_rate(layout, learner_seconds)
    cores = available_cores()
    efficiency = measure_core_efficiency(layout, cores)
    sync: dict[str, Any] = {}
    if group or max(space.learners) > 1:
        costs = measure_local_group(parameters)
        probed = costs["allreduce_latency_s"] / 2  # a ring of two: two messages
        sync = {
            "sync_latency_s": probed,
            "probe_latency_s": probed,
            "sync_bytes_per_s": costs["allreduce_bytes_per_s"],
            "sync_measured": True,
        }
        if cores >= 2:  # what a step's collective really costs two training learners
            grouped = measure_group_training(layout, learner_rate / steps_per_update)
            two_busy = learner_rate * efficiency_at(efficiency, 2, cores)  # what each would do without the group
            sync["group_learner_rate"] = grouped
            sync["sync_latency_s"] = message_latency(
                grouped,
                two_busy,
                steps_per_update,
                gradient_steps,
                4 * parameters / costs["allreduce_bytes_per_s"],
                probed,
            )
    rates = {}
    for k in space.envs:
        actor = build_actor(with_layout(cfg, 1, k, space.fragment_steps), 0)
        actor.collect()  # warm-up: allocation, first inference
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds_per_actor:
            steps += actor.collect().env_steps
        rates[k] = steps / (time.perf_counter() - t0)
        actor.envs.close()
    return Calibration(
        rates,
        learner_rate,
        steps_per_update,
        space.fragment_steps,
        time.perf_counter() - started,
        gradient_steps,
        parameters,
        core_efficiency=efficiency,
        **sync,
    )


def efficiency_at(core_efficiency: float, cores_in_use: float, cores: int) -> float:
    """Speed of each busy core as a fraction of a lone core's: 1 with one core in use, the measured
    `core_efficiency` with all of them, in between linearly."""
    if cores < 2 or cores_in_use <= 1:
        return 1.0
    return 1.0 - (1.0 - core_efficiency) * min(1.0, (cores_in_use - 1) / (cores - 1))


def measure_core_efficiency(layout: Config, cores: int, seconds: float = 2.0) -> float:
    """How fast each core runs while all are busy, as a fraction of one core alone: the learner's update
    loop in one process, then in `cores` processes (at most MAX_COPIES) that start together after their
    warm-up and time the same window; both measured the same way, on the CPU, in forked processes."""
    if cores < 2:
        return 1.0
    cpu = on_cpu(layout)  # the cores are what is measured (and CUDA cannot be used again in a forked child)
    copies = min(cores, MAX_COPIES)
    lone = in_processes("core efficiency (one core)", _timed_learner, [(cpu, seconds, None)])
    start = process_context().Barrier(copies)
    together = in_processes("core efficiency (every core)", _timed_learner, [(cpu, seconds, start)] * copies)
    return min(1.0, sum(together) / len(together) / lone[0])


def _timed_learner(layout: Config, seconds: float, start: Any) -> float:
    return _learner_rate(layout, seconds, start)[0]


def measure_group_training(
    layout: Config, updates_per_s: float, seconds: float = 2.0, timeout_s: float = 60.0
) -> float:
    """Env steps/s each of two learners consumes when they train as an allreduce group on this machine
    (gloo over loopback, a core each): every optimizer step's collective at its real cost, the long
    tail of its waits, the flattening and the slower of the two included."""
    updates = max(3, round(seconds * updates_per_s))  # the same count on both: neither is left waiting
    port = free_loopback_port()
    rates = in_processes(
        "learner group training",
        _group_learner,
        [(on_cpu(layout), GroupSpec(rank, 2, "127.0.0.1", port, timeout_s), updates) for rank in range(2)],
        timeout_s + 60,
    )
    return sum(rates) / len(rates)


def _group_learner(layout: Config, spec: GroupSpec, updates: int) -> float:
    join_group(spec)
    try:
        return _learner_rate(layout, 0.0, group_sync=make_sync("allreduce", 2), updates=updates)[0]
    finally:
        leave_group()


def message_latency(
    group_rate: float,
    learner_rate: float,
    steps_per_update: float,
    optimizer_steps: float,
    bucket_s: float,
    probed: float,
) -> float:
    """One collective message's cost as two training learners pay it: what a step of theirs takes
    beyond a learner's alone (`learner_rate`: with as many cores busy), less the bucket's transfer,
    over the ring's two messages (never below what the probe measured)."""
    per_step = (steps_per_update / group_rate - steps_per_update / learner_rate) / max(optimizer_steps, 1.0)
    return max(probed, (per_step - bucket_s) / 2)


def measure_local_group(parameters: int, learners: int = 2, timeout_s: float = 60.0) -> dict[str, float]:
    """A learner group's collective costs on this machine: `learners` processes form a gloo group
    over loopback and run the probe every learner group runs at start (`probe_group`), with a
    bucket of the model's size."""
    port = free_loopback_port()
    return in_processes(
        "learner group probe",
        probe_group,
        [(GroupSpec(rank, learners, "127.0.0.1", port, timeout_s), parameters) for rank in range(learners)],
        timeout_s + 30,
    )[0]


def in_processes(
    what: str, target: Callable[..., Any], args: list[tuple[Any, ...]], timeout_s: float = 120.0
) -> list[Any]:
    """`target(*a)` for each `a` in `args`, each in a process forked (or spawned) from this one, on
    one torch thread; their results in order. A child's exception, or one that dies or does not
    finish within `timeout_s`, is a RuntimeError naming `what`; the others are stopped."""
    ctx = process_context()
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_child, args=(results, index, target, a, os.getpid())) for index, a in enumerate(args)
    ]
    for process in processes:
        process.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < len(processes):
            try:
                index, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{what}: a process {'exited with ' + str(dead[0]) if dead else 'timed out'}"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"{what}: {value}")
            got[index] = value
        return [got[index] for index in range(len(processes))]
    finally:
        for process in processes:
            process.join(5 if len(got) == len(processes) else 0.1)
            if process.is_alive():
                process.kill()


def _child(results: Any, index: int, target: Callable[..., Any], args: tuple[Any, ...], parent_pid: int) -> None:
    die_with_parent(parent_pid)
    torch.set_num_threads(1)
    try:
        results.put((index, "ok", target(*args)))
    except Exception as exc:  # the parent raises it, naming the measurement
        results.put((index, "error", f"{type(exc).__name__}: {exc}"))


def on_cpu(layout: Config) -> Config:
    raw = layout.model_dump(mode="json")
    raw["learner"]["device"] = "cpu"
    return build_config(raw)


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


def _learner_rate(
    layout: Config, seconds: float, start: Any = None, group_sync: Any = None, updates: int | None = None
) -> tuple[float, float, float, int]:
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
    timed_updates = max(1, learner.updates - updates_before)
    parameters = sum(p.numel() for p in learner.algo.parameters())
    return steps / (time.perf_counter() - t0), steps / timed_updates, hook.calls / max(1, learner.updates), parameters


def process_context() -> Any:
    """fork (fast: nothing to import again), except from a process connected to Ray (a driver under
    --launcher ray): Ray's threads may hold a lock a forked child inherits and hangs on; spawn then."""
    ray = sys.modules.get("ray")
    connected = ray is not None and getattr(ray, "is_initialized", lambda: False)()
    return multiprocessing.get_context("spawn" if connected else "fork")
