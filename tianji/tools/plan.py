"""Resource mapping by measurement: calibrate (`tianji.tools.calibration`), predict layouts, pick one.

    calibration = calibrate(cfg, space)           # ~10-30 s: one learner, the cores, a group of two, the actors
    layouts = predict(calibration, cfg, cores=2)  # every candidate (actors, envs per actor)
    chosen = choose(layouts)

The model: an actor on one core produces P(k) env steps/s with k envs; a learner on one core
consumes C env steps/s (its samples per update divided by the replay ratio, over the update time).
With A actors on c cores the throughput X is bounded by the actors (X <= A * P), by the learner
(X <= C) and by the CPU (X * (1/P + 1/C) <= c). The side with the lower utilisation idles.
Cores are not independent: with every core busy each runs at a measured fraction of a lone core's
speed (`Calibration.core_efficiency`), and the model slows every process by the share of the cores
its layout keeps busy. With more processes than cores they also wait for each other (`core_share`):
a process that wants to run while k others do gets c / (k + 1) of a core, each other process
wanting one as often as it is busy; an allreduce step lasts as long as the slowest learner's; and a
collective message that wakes a learner while every core is taken waits about a scheduler time
slice. A collective message costs what two learners training as a group here measured (gloo over
TCP has a long tail: the mean, not the median, is what training pays).
Changing envs per actor keeps the fragment size (envs x steps) as configured, so the batch an
algorithm trains on does not change with the layout.

The model ranks layouts by throughput; among those it cannot tell apart (within TIE) the choice
follows what the ablations measured (benchmarks/ablations.py): keep slack on the idle side, stay
inside the lag bound (no planned drops), then spread production over up to one actor per core
(PPO and DQN on CartPole both reached the target faster with 2 actors than with 1 on 2 cores,
with the learner the bottleneck in both), then keep envs per actor near the configured value.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tianji.config import Config, build_config
from tianji.runtime.balance import LagController, lag_aware_in_flight
from tianji.runtime.process.life import die_with_parent
from tianji.tools.calibration import (
    Calibration,
    Space,
    available_cores,
    calibrate,
    efficiency_at,
    process_context,
    with_layout,
)

ENV_CHOICES = (4, 8, 16, 32, 64, 128)
ACTOR_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
MAX_ACTORS = 128
TABLE_ROWS = 30  # `tianji plan` prints the fastest layouts (and the chosen one) when there are more
CALIBRATION_VERSION = 2  # part of the cache key: a calibration measured another way is measured again
TIE = 0.05  # layouts within 5 % of the best throughput count as equally fast
HEADROOM = 0.25  # preferred slack on the side that idles
SCHEDULER_SLICE_S = 3e-3  # a woken process that finds every core taken waits about this long (Linux's slice)


@dataclass(frozen=True)
class Layout:
    actors: int
    envs_per_actor: int
    fragment_length: int
    env_steps_per_s: float
    actor_utilization: float
    learner_utilization: float
    max_lag: float  # predicted max policy lag at the learner
    idle_side: str
    held_back: bool = False  # the lag bound keeps fewer fragments in flight than the layout needs
    learners: int = 1
    chosen: bool = False


def layout_space(cfg: Config, cores: int, plan_envs: bool, plan_actors: bool, plan_learners: bool = False) -> Space:
    t = cfg.topology
    k0 = t.envs_per_actor if isinstance(t.envs_per_actor, int) else 16
    steps = k0 * t.fragment_length
    envs = [k for k in ENV_CHOICES if k <= steps] or [k0] if plan_envs else [k0]
    limit = min(MAX_ACTORS, 2 * cores)
    actors = (
        sorted({a for a in ACTOR_CHOICES if a <= limit} | {max(1, cores - 1)})
        if plan_actors
        else [int(t.actors) if t.actors != "auto" else 1]
    )
    if plan_learners:  # powers of two, at most half the cores (each learner wants actors beside it)
        learners = tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n == 1 or n <= cores // 2)
    else:
        learners = (int(t.learners) if t.learners != "auto" else 1,)
    return Space(envs, actors, steps, k0, learners)


def group_learner_rate(
    cal: Calibration, learners: int, mode: str, core_speed: float = 1.0, all_cores_taken: float = 0.0
) -> float:
    """Env steps/s one learner of a group consumes. allreduce adds a ring all-reduce to every
    optimizer step: 2 (L - 1) messages of latency and 2 (L - 1) / L of the gradient bytes at the
    group's bus bandwidth (measured by a group of two on this machine when learners are planned:
    `measure_group_training`, `measure_local_group`); asynchronous averages overlap training. On a shared machine the
    learner computes at `core_speed` of a core, and each message that wakes it finds every core
    taken with probability `all_cores_taken` and then waits a time slice (see `core_share`)."""
    update_s = cal.steps_per_update / cal.learner_rate / core_speed
    if learners == 1 or mode != "allreduce":
        return cal.steps_per_update / update_s
    messages = 2 * (learners - 1)
    per_step = (
        messages * (cal.sync_latency_s + all_cores_taken * SCHEDULER_SLICE_S)
        + 2 * (learners - 1) / learners * 4 * cal.parameters / cal.sync_bytes_per_s
    )
    return cal.steps_per_update / (update_s + cal.optimizer_steps_per_update * per_step)


def core_share(others: list[tuple[int, float]], cores: float) -> tuple[float, float]:
    """A process's speed while it runs (the fraction of a core it gets, expected over how many of the
    others want a core at the same moment: a process that competes with k others gets cores / (k + 1))
    and the probability that the others take every core when it wakes. `others`: (processes, busy
    probability) per kind, each process wanting a core independently."""
    wanting = _others_wanting(others)
    k = np.arange(len(wanting))
    return float(wanting @ np.minimum(1.0, cores / (k + 1))), float(wanting[k >= cores].sum())


def slowest_step(others: list[tuple[int, float]], cores: int, members: int) -> float:
    """A collective waits for the slowest of `members` learners: the expected longest of their step
    times, in steps on a core of its own, each learner drawing its share of a core (`core_share`)
    independently."""
    wanting = _others_wanting(others)
    step = 1.0 / np.minimum(1.0, cores / (np.arange(len(wanting)) + 1))  # step time with k others wanting a core
    below = np.cumsum(wanting)  # P(step time <= step[k]); steps grow with k
    return float(step @ np.diff(np.concatenate([[0.0], np.minimum(below, 1.0) ** members])))


def _others_wanting(others: list[tuple[int, float]]) -> np.ndarray:
    """Probability that exactly k of the others want a core, k = 0, 1, ..."""
    wanting = np.ones(1)
    for count, busy in others:
        k = np.arange(count + 1)
        pmf = np.array([math.comb(count, i) for i in k], dtype=float) * busy**k * (1 - busy) ** (count - k)
        wanting = np.convolve(wanting, pmf)
    return wanting


def shared_throughput(
    cal: Calibration,
    actor_rate: float,
    actors: int,
    producing: float,
    learners: int,
    group: int,
    mode: str,
    cores: int,
    learners_first: bool = False,
) -> tuple[float, float]:
    """Env steps/s of `actors` actors and `learners` learners sharing `cores` cores (the learners are
    part of a group of `group`), and the learners' consumption rate with every one on a core of its
    own (for utilisation). Starts from the plain bounds (actors, learners, CPU) and lets the processes'
    busy fractions, their shares of the cores (`core_share`; under allreduce each step lasts as long as
    the slowest learner's, `slowest_step`) and the cores' speed (`efficiency_at`) settle. `learners_first`
    (niced actors, topology.actor_nice): the learners share the cores only with each other, and the
    actors share what the learners leave."""
    alone = group_learner_rate(cal, group, mode)
    cpu_bound = cores / (1.0 / actor_rate + 1.0 / alone)
    x = min(producing * actor_rate, learners * alone, cpu_bound)
    compute_s = cal.steps_per_update / cal.learner_rate  # a learner's update on a lone core
    crowded = actors + learners > cores
    actor_busy, learner_busy = min(1.0, x / (actors * actor_rate)), 1.0
    for _ in range(20):  # damped fixed point: busy fractions -> shares and speed -> throughput -> busy fractions
        actor_speed, learner_speed, step_speed, taken = 1.0, 1.0, 1.0, 0.0
        if crowded:
            if learners_first:
                others = [(learners - 1, learner_busy)]
                learner_speed, taken = core_share(others, cores)
                left = max(cores - learners * learner_busy * learner_speed, 1e-3)
                actor_speed, _ = core_share([(actors - 1, actor_busy)], left)
            else:
                actor_speed, _ = core_share([(actors - 1, actor_busy), (learners, learner_busy)], cores)
                others = [(actors, actor_busy), (learners - 1, learner_busy)]
                learner_speed, taken = core_share(others, cores)
            step_speed = learner_speed if group == 1 or mode != "allreduce" else 1 / slowest_step(others, cores, group)
        in_use = min(cores, actors * actor_busy * actor_speed + learners * learner_busy * learner_speed)
        speed = efficiency_at(cal.core_efficiency, in_use, cores)
        learner_rate = group_learner_rate(cal, group, mode, step_speed * speed, taken)
        bound = min(producing * actor_rate * actor_speed * speed, learners * learner_rate, speed * cpu_bound)
        x = (x + bound) / 2
        actor_busy = min(1.0, x / (actors * actor_rate * actor_speed * speed))
        # a learner waiting for its group's message does not want a core
        update_s = cal.steps_per_update / learner_rate
        learner_busy = min(1.0, x / (learners * learner_rate)) * compute_s / (learner_speed * speed) / update_s
    return x, alone


# ---------------------------------------------------------------- prediction


def predict(
    cal: Calibration, cfg: Config, space: Space, cores: int, replicas: int = 1, others_in_group: int | None = None
) -> list[Layout]:
    """Every candidate (learners, actors, envs per actor): actors are dealt evenly to learners, and all
    share the machine's cores (`shared_throughput`). With `replicas` machines running the same layout,
    the learners of all of them form one group (the collective's ring is `replicas` times longer; pass
    `cal` with the link's costs); `others_in_group`: instead, the group has this many learners on
    other machines whatever the layout here (a cluster of unlike nodes)."""
    versions_per_fragment = cal.fragment_steps / cal.steps_per_update
    # under auto the controller raises the bound while the learner waits, up to its ceiling: no layout is
    # held back, and each one's lag is capped where the controller settles on it (`auto_bound`)
    auto = cfg.balance.lag_is_auto
    bound = LagController.high if auto else cfg.balance.bound_at_start
    limit = lag_aware_in_flight(bound, versions_per_fragment) if cfg.balance.backpressure else math.inf
    layouts = []
    for k in space.envs:
        rate = cal.actor_rates[k]
        for learners in space.learners:
            for a in (a for a in space.actors if a >= learners):
                per_learner = math.ceil(a / learners)
                producing = min(a, learners * limit)  # lag-aware credits: at most `limit` in flight per learner
                group = learners * replicas if others_in_group is None else learners + others_in_group
                x, learner_rate = shared_throughput(
                    cal, rate, a, producing, learners, group, cfg.sync.mode, cores, cfg.topology.actor_nice > 0
                )
                actor_util, learner_util = x / (a * rate), x / (learners * learner_rate)
                actors_wait = actor_util < learner_util
                lag = predicted_max_lag(per_learner, versions_per_fragment, cfg.balance.max_inflight, actors_wait)
                learner_bound = learner_util >= actor_util
                held_back = limit < per_learner + (1 if learner_bound else 0)
                bound_here = auto_bound(per_learner, learner_bound, versions_per_fragment) if auto else bound
                idle = (
                    "actors"
                    if actor_util < learner_util - 0.02
                    else "learner"
                    if learner_util < actor_util - 0.02
                    else "neither"
                )
                layouts.append(
                    Layout(
                        a,
                        k,
                        max(1, cal.fragment_steps // k),
                        x,
                        actor_util,
                        learner_util,
                        min(lag, bound_here) if cfg.balance.backpressure else lag,
                        idle,
                        held_back,
                        learners,
                    )
                )
    return layouts


@dataclass(frozen=True)
class ClusterPrediction:
    nodes: int
    cores_per_node: int
    per_node: Layout  # every node runs this layout; its learners join one group across the nodes
    env_steps_per_s: float  # the whole cluster
    group: int  # learners in the group


def predict_cluster(
    cal: Calibration,
    cfg: Config,
    nodes: int,
    cores_per_node: int,
    link_bytes_per_s: float,
    link_latency_s: float,
    gpu_learner_rate: float | None = None,
    others_in_group: int | None = None,
) -> ClusterPrediction:
    """What-if for `nodes` machines of `cores_per_node` cores like this one: every node runs the layout
    the planner would choose for its cores, actors feeding the learners of their own node (shared
    memory), and all learners form one group whose collectives cross the link (its bandwidth caps
    the bus bandwidth measured here; its latency adds to a message's). Under sync.mode average the
    collectives overlap training, so nodes add throughput until something else binds.
    `gpu_learner_rate`: one learner per node, on a GPU that consumes this many env steps/s (measure it
    on a GPU machine with `tianji plan PRESET --set learner.device=cuda`); it barely uses a core."""
    space = layout_space(cfg, cores_per_node, plan_envs=True, plan_actors=True, plan_learners=True)
    if gpu_learner_rate is not None:
        cal = replace(cal, learner_rate=gpu_learner_rate)
        space = replace(space, learners=(1,))
    if nodes > 1:
        cal = replace(
            cal,
            sync_latency_s=cal.sync_latency_s + link_latency_s,
            sync_bytes_per_s=min(cal.sync_bytes_per_s, link_bytes_per_s),
        )
    chosen = choose(
        predict(cal, cfg, space, cores_per_node, replicas=nodes, others_in_group=others_in_group),
        space.preferred_envs,
        cores_per_node,
    )
    group = nodes * chosen.learners if others_in_group is None else chosen.learners + others_in_group
    return ClusterPrediction(nodes, cores_per_node, chosen, nodes * chosen.env_steps_per_s, group)


def link_from_probe(cal: Calibration, costs: dict[str, float]) -> tuple[float, float]:
    """The link (bytes/s, one message's latency) that a group probe across two nodes measured, in the
    terms `predict_cluster` adds to the group costs measured on one machine."""
    return costs["allreduce_bytes_per_s"], max(0.0, costs["allreduce_latency_s"] / 2 - cal.probe_latency_s)


def plan_cluster(
    cal: Calibration,
    cfg: Config,
    nodes: list[dict[str, float]],
    link_bytes_per_s: float,
    link_latency_s: float,
    gpu_learner_rate: float | None = None,
) -> tuple[list[Layout], float, str]:
    """A layout for a described cluster (each alive node's resources, as Ray lists them): every node
    runs the layout chosen for its own CPUs (and, given `gpu_learner_rate`, one learner on its GPU
    when it has one), actors feeding the learners of their node, and all learners form one group
    over the link. Returns the layout per node, the predicted env steps/s of the whole cluster, and why."""
    usable = [n for n in nodes if int(n.get("CPU", 0)) >= 2]  # a node needs a core for a learner and an actor
    if not usable:
        raise ValueError(f"no node of the cluster has 2 CPUs for a learner and an actor: {nodes}")

    def kind(node: dict[str, float]) -> tuple[int, bool]:
        return int(node["CPU"]), gpu_learner_rate is not None and node.get("GPU", 0) >= 1

    kinds = sorted({kind(n) for n in usable})

    def lay_out(others: dict[tuple[int, bool], int | None]) -> dict[tuple[int, bool], Layout]:
        return {
            k: predict_cluster(
                cal,
                cfg,
                len(usable),
                k[0],
                link_bytes_per_s,
                link_latency_s,
                gpu_learner_rate if k[1] else None,
                others[k],
            ).per_node
            for k in kinds
        }

    chosen = lay_out(dict.fromkeys(kinds))  # as if every node were of its kind
    if len(kinds) > 1:  # unlike nodes: price each kind's collectives with the group the others form
        group = sum(chosen[kind(n)].learners for n in usable)
        chosen = lay_out({k: group - chosen[k].learners for k in kinds})
    layouts = [chosen[kind(n)] for n in usable]
    total = sum(layout.env_steps_per_s for layout in layouts)
    group = sum(layout.learners for layout in layouts)
    bound = {"actors": "the learners", "learner": "the actors", "neither": "both"}
    described = "; ".join(
        f"{sum(kind(n) == k for n in usable)} node(s) of {k[0]} CPUs{' and a GPU' if k[1] else ''}: "
        f"{chosen[k].learners} learner(s){' on the GPU' if k[1] else ''} x {chosen[k].actors} actors x "
        f"{chosen[k].envs_per_actor} envs, bounded by {bound[chosen[k].idle_side]}"
        for k in kinds
    )
    skipped = len(nodes) - len(usable)
    link = (
        f"across the link ({link_bytes_per_s * 8 / 1e9:.3g} Gbit/s, {link_latency_s * 1e6:.0f} us)"
        if len(usable) > 1
        else "on the node"
    )
    why = (
        f"why: {described}; {group} learners in one {cfg.sync.mode} group {link}; predicted {total:,.0f} env "
        f"steps/s" + (f"; {skipped} node(s) with fewer than 2 CPUs left out" if skipped else "")
    )
    return layouts, total, why


def format_cluster(
    cal: Calibration,
    predictions: list[ClusterPrediction],
    link_bytes_per_s: float,
    link_latency_s: float,
    mode: str,
    gpu_learner_rate: float | None = None,
) -> str:
    """The what-if table: per cluster size, the layout on every node, the group, the predicted rate."""
    base = predictions[0].env_steps_per_s / predictions[0].nodes
    gpu = (
        "" if gpu_learner_rate is None else f"; one GPU learner per node at {gpu_learner_rate:,.0f} env steps/s (given)"
    )
    lines = [
        f"predicted for nodes of {predictions[0].cores_per_node} cores like this one (rates measured here{gpu}; "
        f"link {link_bytes_per_s * 8 / 1e9:g} Gbit/s, {link_latency_s * 1e6:g} us; learner group {mode}, "
        f"{'measured' if cal.sync_measured else 'assumed'} on this machine: a message "
        f"{cal.sync_latency_s * 1e6:,.0f} us, {cal.sync_bytes_per_s / 1e6:,.0f} MB/s):",
        f"  {'nodes':>5} {'group':>5} {'per node: learners x actors x envs':>36} {'pred env steps/s':>17} "
        f"{'speed-up':>8} {'learner util':>12} {'max lag':>7}",
    ]
    for p in predictions:
        n = p.per_node
        lines.append(
            f"  {p.nodes:>5} {p.group:>5} {f'{n.learners} x {n.actors} x {n.envs_per_actor}':>36} "
            f"{p.env_steps_per_s:>17,.0f} {p.env_steps_per_s / base:>7.2f}x {n.learner_utilization:>11.0%} "
            f"{n.max_lag:>7.1f}"
        )
    return "\n".join(lines)


def predicted_max_lag(actors: int, versions_per_fragment: float, max_inflight: int, actors_wait: bool) -> float:
    """Largest lag expected at the learner with plain credits. While one fragment is produced the
    learner advances `versions_per_fragment` per fragment it takes from every actor; when the actors
    wait for it, each actor's whole queue of credits is ahead of it. An actor reads new weights only
    before a fragment, so the newest fragment is up to one more fragment (at least one version) behind.
    Lag-aware credits (tianji.runtime.balance.CreditLedger) cap it at balance.max_policy_lag."""
    queue = max_inflight if actors_wait else 1
    return actors * versions_per_fragment * queue + max(1.0, versions_per_fragment)


def bound_needed(actors: int, learner_bound: bool, versions_per_fragment: float) -> float:
    """The smallest balance.max_policy_lag that keeps `actors` producing (and, learner-bound, one queued)."""
    return 2 * versions_per_fragment * (actors + (1 if learner_bound else 0) - 1)


def auto_bound(actors: int, learner_bound: bool, versions_per_fragment: float) -> int:
    """Where `balance.max_policy_lag: auto` ends up while stale data teach, for `actors` per learner: the
    controller raises the bound while the learner waits, so it stops at the smallest bound that keeps
    them producing (`bound_needed`), within the controller's limits."""
    needed = bound_needed(actors, learner_bound, versions_per_fragment)
    return min(max(math.ceil(needed), LagController.low), LagController.high)


def settled_bound(cal: Calibration, layout: Layout) -> int:
    """`auto_bound` of a planned layout."""
    learner_bound = layout.learner_utilization >= layout.actor_utilization
    per_learner = math.ceil(layout.actors / layout.learners)
    return auto_bound(per_learner, learner_bound, cal.fragment_steps / cal.steps_per_update)


def choose(layouts: list[Layout], preferred_envs: int, cores: int | None = None) -> Layout:
    """Highest predicted throughput; near-ties (within TIE) are broken, in order, by
    - slack: the idle side keeps HEADROOM (calibration is noisy: a side predicted at 90 % may be
      the bottleneck in practice);
    - the lag bound: a layout it does not hold back (every actor producing, the learner fed);
    - fewer learners: each more is a process to synchronise (and, with allreduce, to wait for);
    - more actors, up to one per core: production spread over processes keeps the learner fed
      when one actor stalls, and measured faster to the target than one actor on 2 cores;
    - envs per actor closest to the configured value (the batch shape is a tuned hyperparameter);
    - lower lag."""
    per_core = cores or max(c.actors for c in layouts)
    best = max(c.env_steps_per_s for c in layouts)
    fast = [c for c in layouts if c.env_steps_per_s >= (1 - TIE) * best]
    pick = min(
        fast,
        key=lambda c: (
            min(c.actor_utilization, c.learner_utilization) > 1 - HEADROOM,
            c.held_back,
            c.learners,
            -min(c.actors, per_core),
            abs(math.log2(c.envs_per_actor / preferred_envs)),
            round(c.max_lag, 6),
            c.actors,
        ),
    )
    return Layout(**{**asdict(pick), "chosen": True})


def lag_warning(cal: Calibration, cfg: Config, chosen: Layout) -> str | None:
    """A warning when the lag bound holds the chosen layout back, with the bound that would not."""
    if not chosen.held_back:
        return None
    vpf = cal.fragment_steps / cal.steps_per_update
    per_learner = math.ceil(chosen.actors / chosen.learners)
    needed = bound_needed(per_learner, chosen.learner_utilization >= chosen.actor_utilization, vpf)
    return (
        f"warning: balance.max_policy_lag={cfg.balance.bound_at_start} is too tight for {per_learner} actors "
        f"per learner: "
        f"lag-aware credits keep {lag_aware_in_flight(cfg.balance.bound_at_start, vpf)} fragment(s) in flight "
        f"({vpf:.2g} versions each), so actors wait for fresh weights (nothing is dropped); "
        f"a bound of {math.ceil(needed)} keeps them all busy"
    )


def oversubscription_warning(cfg: Config, cores: int) -> str | None:
    """A warning when a hand-set layout gives each actor less than half a core while all of them step."""
    t = cfg.topology
    wanted = t.actor_count * t.actor_threads
    if wanted <= 2 * cores:
        return None
    return (
        f"warning: {t.actor_count} actors x {t.actor_threads} thread(s) on {cores} cores: each gets about "
        f"1/{wanted / cores:.0f} of a core while all step; they run niced (topology.actor_nice), so the "
        f"learner keeps its core, but memory and start-up grow with every actor and fragments take "
        f"{wanted / cores:.0f}x as long; `tianji plan {cfg.name}` (or topology.actors: auto) measures the "
        "fastest layout here"
    )


def explain(cal: Calibration, chosen: Layout, cores: int, mode: str = "allreduce") -> str:
    """Why this layout: what bounds its throughput, from the measured rates."""
    learner_rate = group_learner_rate(cal, chosen.learners, mode)
    cpu_bound = cores / (1.0 / cal.actor_rates[chosen.envs_per_actor] + 1.0 / learner_rate)
    bounds = {
        "the learners": chosen.learners * learner_rate,
        "the actors": chosen.actors * cal.actor_rates[chosen.envs_per_actor],
        f"the {cores} cores (actors and learners share them)": cpu_bound,
    }
    limit = min(bounds, key=lambda name: bounds[name])
    more = (
        ""
        if chosen.learners == 1
        else f"; one learner would cap it at {cal.learner_rate:,.0f} env steps/s, so {chosen.learners} learners share "
        f"the training (actors dealt evenly, {math.ceil(chosen.actors / chosen.learners)} each; sync.mode {mode} "
        f"leaves each {learner_rate:,.0f} env steps/s)"
    )
    return (
        f"why: {chosen.learners} learner(s) x {chosen.actors} actors x {chosen.envs_per_actor} envs is predicted "
        f"to reach {chosen.env_steps_per_s:,.0f} env steps/s, bounded by {limit}{more}; among layouts within "
        f"{TIE:.0%} of the best it keeps the most slack, stays inside the lag bound and has the fewest learners"
    )


def mark(layouts: list[Layout], chosen: Layout) -> list[Layout]:
    same = (chosen.learners, chosen.actors, chosen.envs_per_actor)
    return [chosen if (c.learners, c.actors, c.envs_per_actor) == same else c for c in layouts]


# ---------------------------------------------------------------- cache and start-up resolution


def _cache_dir() -> Path:
    return Path(os.environ.get("TIANJI_CACHE_DIR", Path.home() / ".cache" / "tianji")) / "plans"


def _machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return {"node": platform.node(), "cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version()}


def cache_key(cfg: Config, space: Space) -> str:
    """Same machine, same things that set the rates (env, algorithm, balance) and same layout space."""
    raw = cfg.model_dump(mode="json")
    relevant = {k: raw[k] for k in ("env", "algo", "balance")}
    relevant["space"] = asdict(space)
    blob = json.dumps({"machine": _machine(), "config": relevant, "version": CALIBRATION_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_or_calibrate(cfg: Config, space: Space, use_cache: bool = True) -> tuple[Calibration, bool]:
    """A cached calibration for this machine and config, or a fresh one (measured in a child process)."""
    path = _cache_dir() / f"{cache_key(cfg, space)}.json"
    if use_cache and path.is_file():
        try:
            raw = json.loads(path.read_text())
            raw["actor_rates"] = {int(k): v for k, v in raw["actor_rates"].items()}
            return Calibration(**raw), True
        except (ValueError, TypeError, KeyError):
            pass  # unreadable cache: measure again
    cal = _calibrate_in_child(cfg, space)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(cal)))
    os.replace(tmp, path)
    return cal, False


def _calibrate_child(cfg_json: str, space: Space, conn, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    try:
        conn.send(("ok", json.dumps(asdict(calibrate(build_config(json.loads(cfg_json)), space)))))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _calibrate_in_child(cfg: Config, space: Space) -> Calibration:
    # in a child so the caller (a driver about to fork roles) never starts torch thread pools itself
    ctx = process_context()
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_calibrate_child, args=(json.dumps(cfg.model_dump(mode="json")), space, child, os.getpid())
    )
    process.start()
    child.close()
    status, payload = parent.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(f"calibration failed: {payload}")
    raw = json.loads(payload)
    raw["actor_rates"] = {int(k): v for k, v in raw["actor_rates"].items()}
    return Calibration(**raw)


def needs_plan(cfg: Config) -> bool:
    t = cfg.topology
    return "auto" in (t.actors, t.envs_per_actor, t.learners)


def resolve_layout(cfg: Config, cores: int | None = None) -> tuple[Config, dict[str, Any]]:
    """Replace `auto` in the topology by the planned layout; returns the config and the plan record."""
    cores = cores or available_cores()
    space = layout_space(
        cfg,
        cores,
        plan_envs=cfg.topology.envs_per_actor == "auto",
        plan_actors=cfg.topology.actors == "auto",
        plan_learners=cfg.topology.learners == "auto",
    )
    cal, cached = load_or_calibrate(cfg, space)
    chosen = choose(predict(cal, cfg, space, cores), space.preferred_envs, cores)
    record = {
        "calibration": asdict(cal),
        "cached": cached,
        "cores": cores,
        "chosen": asdict(chosen),
        "warning": lag_warning(cal, cfg, chosen),
    }
    planned = with_layout(cfg, chosen.actors, chosen.envs_per_actor, space.fragment_steps, chosen.learners)
    if cfg.balance.lag_is_auto:  # start the controller where it would end up on this layout
        record["lag_start"] = settled_bound(cal, chosen)
        planned = planned.model_copy(
            update={"balance": planned.balance.model_copy(update={"lag_start": record["lag_start"]})}
        )
    return planned, record


def format_table(cal: Calibration, layouts: list[Layout], cores: int) -> str:
    lines = [
        f"calibration ({cal.seconds:.1f} s, one core each): learner consumes {cal.learner_rate:,.0f} env steps/s "
        f"({cal.steps_per_update:,.0f} per update)"
    ]
    lines.append(
        "  actor env steps/s by envs per actor: "
        + ", ".join(f"{k}: {r:,.0f}" for k, r in sorted(cal.actor_rates.items()))
    )
    lines.append(f"  with every core busy, each runs at {cal.core_efficiency:.0%} of a lone core's speed")
    if cal.sync_measured:
        trained = (
            f"; two learners training as a group: {cal.group_learner_rate:,.0f} env steps/s each"
            if cal.group_learner_rate
            else ""
        )
        lines.append(
            f"  learner group (measured: two learners on this machine): a collective message "
            f"{cal.sync_latency_s * 1e6:,.0f} us (the probe's: {cal.probe_latency_s * 1e6:,.0f} us), "
            f"{cal.sync_bytes_per_s / 1e6:,.1f} MB/s{trained}"
        )
    lines.append(f"layouts for {cores} cores (fragment = {cal.fragment_steps} env steps):")
    shown = layouts
    if len(layouts) > TABLE_ROWS:
        lines.append(f"  (the {TABLE_ROWS} fastest of {len(layouts)} layouts, and the chosen one)")
        fastest = sorted(layouts, key=lambda c: -c.env_steps_per_s)[:TABLE_ROWS]
        shown = fastest + [c for c in layouts if c.chosen and c not in fastest]
    lines.append(
        f"  {'':2}{'learners':>8} {'actors':>6} {'envs':>5} {'T':>5} {'pred steps/s':>13} {'actor util':>10} "
        f"{'learner util':>12} {'max lag':>7}  idle"
    )
    for c in sorted(shown, key=lambda c: (c.learners, c.envs_per_actor, c.actors)):
        lines.append(
            f"  {'*' if c.chosen else ' ':2}{c.learners:>8} {c.actors:>6} {c.envs_per_actor:>5} {c.fragment_length:>5} "
            f"{c.env_steps_per_s:>13,.0f} {c.actor_utilization:>10.0%} {c.learner_utilization:>12.0%} "
            f"{c.max_lag:>7.1f}  {c.idle_side}{' (held back by the lag bound)' if c.held_back else ''}"
        )
    return "\n".join(lines)
