"""Where a learner's time goes, per phase of an update, on ready fragments (no actors running):

    python benchmarks/learner_profile.py [--preset pong-appo] [--updates 20] [--threads 1] [--set key=value ...]

Each phase is timed where the learner calls it (wrapped here, nothing in the package changes) and
counted once: a phase's time excludes the phases inside it, so the rows add up to the update.
PyTorch runs CPU kernels synchronously, so a wall-clock timer around a call is the kernel's time.

    batch to tensors    fragments laid side by side as tensors (time_major_batch)
    targets forward     the no-gradient pass over the whole batch that V-trace / GAE need
    V-trace / GAE       the targets and advantages themselves
    minibatch gather    the rows of each minibatch taken from the batch, and its stats summed
    input prep          uint8 frames to scaled floats in the convolutions' layout
    forward             the net's training forward pass (minus input prep)
    loss                the surrogate, value and entropy terms
    backward            loss.backward()
    gradient clip       the global norm and its clip
    optimizer           the Adam / RMSprop step
    publish weights     the weights as numpy arrays and their wire frames, once per update
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import tianji.algos.appo as appo
import tianji.algos.common.vtrace_batch as vtrace_batch
import tianji.algos.impala as impala
import tianji.algos.ppo as ppo
from tianji.config import load_config
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.runtime.transport.wire import encode

PHASES = (
    "batch to tensors",
    "targets forward",
    "V-trace / GAE",
    "minibatch gather",
    "input prep",
    "forward",
    "loss",
    "backward",
    "gradient clip",
    "optimizer",
    "update, other",
    "publish weights",
)


class PhaseClock:
    """Exclusive wall time per phase: time spent inside a nested phase counts only for the inner one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [phase, start, time of the phases inside it]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[1]
            self.seconds[name] += spent - frame[2]
            if self._stack:
                self._stack[-1][2] += spent

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return function(*args, **kwargs)

        return timed

    def patch(self, owner: object, attribute: str, name: str) -> None:
        if hasattr(owner, attribute):
            setattr(owner, attribute, self.wrap(name, getattr(owner, attribute)))


def instrument(learner: Any, clock: PhaseClock) -> None:
    """Wrap every phase the learner's update goes through; `learner.update` becomes the outer phase."""
    algo = learner.algo
    for module in (appo, impala, ppo):
        for attribute in ("time_major_batch", "time_major"):
            clock.patch(module, attribute, "batch to tensors")
        clock.patch(module, "minibatch_steps", "minibatch gather")
        clock.patch(module, "ppo_loss", "loss")
        clock.patch(module, "vtrace_of", "V-trace / GAE")
        clock.patch(module, "compute_gae", "V-trace / GAE")
    clock.patch(vtrace_batch, "vtrace_of", "V-trace / GAE")
    net = algo.net
    trunk = getattr(net, "body", None)
    if trunk is not None and hasattr(trunk, "_frames"):
        clock.patch(trunk, "_frames", "input prep")
    evaluate = net.evaluate

    def forward(*args: Any, **kwargs: Any) -> Any:
        name = "forward" if torch.is_grad_enabled() else "targets forward"
        with clock.phase(name):
            return evaluate(*args, **kwargs)

    net.evaluate = forward
    clock.patch(net, "value", "targets forward")
    clock.patch(torch.Tensor, "backward", "backward")
    clock.patch(torch.nn.utils, "clip_grad_norm_", "gradient clip")
    clock.patch(algo.step.optimizer, "step", "optimizer")
    clock.patch(learner, "update", "update, other")


def profile(preset: str, overrides: list[str], updates: int, threads: int) -> tuple[dict[str, float], int, float]:
    """Seconds per update by phase, samples per update, and samples/s over `updates` updates (after two
    to warm up)."""
    torch.set_num_threads(threads)
    cfg = load_config(preset, overrides)
    actor = build_actor(cfg, 0)
    fragments = [actor.collect() for _ in range(2)]
    actor.envs.close()
    learner = build_learner(cfg)
    clock = PhaseClock()
    instrument(learner, clock)
    publish = clock.wrap("publish weights", lambda: encode({"kind": "weights"}, learner.weights()))
    done, start, i = -2, 0.0, 0
    while done < updates:
        while learner.wants_data():
            fragment = fragments[i % len(fragments)]
            fragment.policy_version = learner.version
            learner.consume(fragment)
            i += 1
        if not learner.ready():
            continue
        learner.update()
        publish()
        done += 1
        if done == 0:  # warmed up: count from here
            clock.seconds.clear()
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    per_update = {name: clock.seconds.get(name, 0.0) / updates for name in PHASES}
    samples = learner.algo.samples_per_update()
    return per_update, samples, samples * updates / elapsed


def table(preset: str, per_update: dict[str, float], samples: int, rate: float, threads: int) -> str:
    total = sum(per_update.values())
    lines = [
        f"{preset}, {threads} torch thread(s), {samples} samples per update: "
        f"{total * 1000:.0f} ms per update, {rate:,.0f} samples/s",
        "",
        "| phase | ms per update | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {s * 1000:.1f} | {s / total:.0%} |" for name, s in per_update.items() if s > 0]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-appo")
    parser.add_argument("--updates", type=int, default=20, help="updates timed (after two to warm up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    args = parser.parse_args()
    np.random.seed(0)
    per_update, samples, rate = profile(args.preset, args.overrides, args.updates, args.threads)
    print(table(args.preset, per_update, samples, rate, args.threads))


if __name__ == "__main__":
    main()
