"""Pong throughput on this machine, every rate measured in one run on the same cores:

    python benchmarks/atari_throughput.py [--preset pong-ppo] [--seconds 20] [--set key=value ...]

1. raw ale-py vector env steps/s with random actions (one thread, the preset's envs per actor);
2. one actor: env steps/s with policy inference, fragments collected (one core);
3. one learner: samples/s trained from ready fragments (one core);
4. end to end: `tianji train PRESET` env steps/s over its last `--seconds` (start-up excluded);
5. the balanced limit of this machine for the measured actor and learner rates,
   cores / (1 / actor rate + 1 / learner rate), and the end-to-end rate as a fraction of it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tianji.config import load_config
from tianji.envs.make import make_vector_env
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.tools.calibration import available_cores

from common import steady_rate


def raw_env_rate(cfg, seconds: float) -> float:
    envs = make_vector_env(cfg.env, cfg.topology.envs_per_actor, threads=1)
    envs.reset(seed=0)
    n, steps, start = envs.num_envs, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(np.random.randint(0, envs.single_action_space.n, n))
        steps += n
    envs.close()
    return steps / (time.perf_counter() - start)


def actor_rate(cfg, seconds: float) -> float:
    actor = build_actor(cfg, 0)
    actor.collect()  # warm-up
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += actor.collect().env_steps
    actor.envs.close()
    return steps / (time.perf_counter() - start)


def learner_rate(cfg, seconds: float) -> float:
    actor = build_actor(cfg, 0)
    fragments = [actor.collect() for _ in range(2)]
    actor.envs.close()
    learner = build_learner(cfg)
    samples, start, i = 0, None, 0
    while start is None or time.perf_counter() - start < seconds:
        while learner.wants_data():
            fragment = fragments[i % len(fragments)]
            fragment.policy_version = learner.version
            learner.consume(fragment)
            i += 1
        if learner.ready():
            learner.update()
            if start is None:  # the first update warms up
                start = time.perf_counter()
                continue
            samples += learner.algo.samples_per_update()
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-ppo")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per measurement")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.preset, args.overrides)
    cores = available_cores()
    raw = raw_env_rate(cfg, args.seconds / 2)
    acting = actor_rate(cfg, args.seconds / 2)
    training = learner_rate(cfg, args.seconds)
    limit = cores / (1 / acting + 1 / training)
    end_to_end, busy = steady_rate(args.preset, args.overrides, args.seconds)
    k, T = cfg.topology.envs_per_actor, cfg.topology.fragment_length
    print(
        f"{args.preset} on {cores} cores ({k} envs per actor, fragments of {T} steps, "
        f"{cfg.topology.actors} actor(s), {cfg.topology.learners} learner(s))"
    )
    print(f"  raw env, random actions, 1 thread      {raw:>9,.0f} env steps/s")
    print(f"  one actor (env + inference), 1 core    {acting:>9,.0f} env steps/s")
    print(f"  one learner, 1 core                    {training:>9,.0f} samples/s")
    print(f"  balanced limit on {cores} cores            {limit:>9,.0f} env steps/s")
    print(
        f"  end to end (tianji train, steady)      {end_to_end:>9,.0f} env steps/s "
        f"(actor busy {busy['perf/actor_busy']:.0%}, learner busy {busy['perf/learner_busy']:.0%})"
    )
    print(f"  end to end / balanced limit            {end_to_end / limit:>9.2f}")


if __name__ == "__main__":
    main()
