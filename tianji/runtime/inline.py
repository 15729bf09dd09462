"""Inline launcher: every role in this process, stepped in a fixed order (tests, debugging)."""

from __future__ import annotations

import time

import torch

from tianji.checkpoint import load_learner, save_driver, save_learner
from tianji.metrics import Monitor
from tianji.runtime.build import build_actor, build_evaluator, build_learner
from tianji.runtime.events import ActorReporter, LearnerReporter
from tianji.runtime.run import RunContext


def run_inline(run: RunContext, monitor: Monitor) -> str:
    """Train until a stop condition; returns the stop reason."""
    cfg = run.cfg
    torch.set_num_threads(cfg.topology.learner_threads)
    learner = build_learner(cfg, load_learner(run.checkpoint_dir) if run.resumed else None)
    actors = [build_actor(cfg, i) for i in range(cfg.topology.actors)]
    weights = learner.weights()
    for actor in actors:
        actor.set_weights(learner.version, weights)
    actor_reporters = [ActorReporter(a) for a in actors]
    learner_reporter = LearnerReporter(learner)

    def checkpoint() -> None:
        save_learner(run.checkpoint_dir, learner.state_dict())
        save_driver(run.checkpoint_dir, monitor.state())

    evaluator = build_evaluator(cfg) if cfg.eval.interval_s is not None else None
    last_checkpoint = last_eval = time.time()
    reason = None
    try:
        while (reason := monitor.stop_reason()) is None:
            for actor, reporter in zip(actors, actor_reporters):
                if learner.wants_data():
                    learner.consume(actor.collect())
                    monitor.on_event(reporter.event())
                while learner.ready():
                    learner.update()
                    if learner.version % cfg.balance.publish_every == 0:
                        weights = learner.weights()
                        for a in actors:
                            a.set_weights(learner.version, weights)
                monitor.on_event(learner_reporter.event())
            if evaluator is not None and time.time() - last_eval >= cfg.eval.interval_s:
                evaluator.set_weights(learner.version, learner.weights())
                monitor.on_event(evaluator.evaluate())
                last_eval = time.time()
            monitor.tick()
            if time.time() - last_checkpoint >= cfg.checkpoint.interval_s:
                checkpoint()
                last_checkpoint = time.time()
    except KeyboardInterrupt:
        reason = "interrupted"
    checkpoint()
    for actor in actors:
        actor.envs.close()
    return reason
