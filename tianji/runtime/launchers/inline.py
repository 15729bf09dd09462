"""Inline launcher: every role in this process, stepped in a fixed order (tests, debugging).

It drives the same `LearnerService` as the other launchers, by calls instead of sockets: each
actor says hello, fills only the slots the service grants it, from weights at least as new as the
grant asks, and the service trains, bounds lag, limits the replay ratio and returns the slots.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from tianji.runtime.driver.keeper import CheckpointKeeper
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.roles.actor import Actor
from tianji.runtime.roles.build import build_actor, build_evaluator, build_learner
from tianji.runtime.roles.reporters import ActorReporter
from tianji.runtime.roles.service import LearnerService
from tianji.runtime.shared.checkpoint import FileStore
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.protocol import FragmentNotice, Hello
from tianji.runtime.transport.wire import unpack_header


def run_inline(run: RunContext, monitor: Monitor) -> str:
    """Train until a stop condition; returns the stop reason."""
    cfg = run.cfg
    torch.set_num_threads(cfg.topology.learner_threads)
    store, keeper = FileStore(run.checkpoint_dir), CheckpointKeeper(run, monitor)
    service: LearnerService[int] = LearnerService(build_learner(cfg, store.load() if run.resumed else None), cfg)
    actors = [build_actor(cfg, i) for i in range(cfg.topology.actor_count)]
    credits: dict[Hashable, deque] = {a.actor_id: deque() for a in actors}  # granted (slot, min_version, exact)
    for actor in actors:
        actor.set_weights(*service.hello(actor.actor_id, Hello(actor=actor.actor_id)))
    actor_reporters = [ActorReporter(a) for a in actors]

    def checkpoint() -> None:  # what a learner process sends, handled as the driver handles it
        keeper.on_notice(unpack_header(store.save(service.learner.state_dict())[0]), [])

    evaluator = build_evaluator(cfg) if cfg.eval.interval_s is not None else None
    last_eval = time.time()
    reason = None
    try:
        while (reason := monitor.stop_reason()) is None:
            for actor, reporter in zip(actors, actor_reporters, strict=True):
                for grant in service.grants():
                    credits[grant.peer].append((grant.slot, grant.min_version, grant.weights))
                if credits[actor.actor_id] and service.wants_data():
                    _collect(actor, credits[actor.actor_id].popleft(), service)
                    monitor.on_event(reporter.event())
                published = service.step()  # at most one update per turn, as the learner loop does
                if published is not None:
                    for a in actors:
                        a.set_weights(*published)
                monitor.on_event(service.reporter.event())
            if evaluator is not None and time.time() - last_eval >= (cfg.eval.interval_s or 0.0):
                evaluator.set_weights(service.published, service.published_weights)
                monitor.on_event(evaluator.evaluate())
                last_eval = time.time()
            monitor.tick()
            if service.checkpoint_due():
                checkpoint()
    except KeyboardInterrupt:
        reason = "interrupted"
    checkpoint()
    for actor in actors:
        actor.envs.close()
    return reason


def _collect(actor: Actor, credit: tuple[int, int, Any], service: LearnerService) -> None:
    """Fill one granted slot and hand it over, as an actor process does through its slot file."""
    slot, min_version, exact = credit
    if exact is not None:  # a deterministic schedule: exactly these weights
        actor.set_weights(min_version, exact, force=True)
    assert actor.version >= min_version, "inline actors get every publish at once"
    fragment = actor.collect()
    notice = FragmentNotice(
        slot, service.epoch, actor.actor_id, fragment.seq, fragment.policy_version, fragment.env_steps
    )
    if service.notice(actor.actor_id, notice):
        service.take(actor.actor_id, slot, fragment, in_slot=True)
