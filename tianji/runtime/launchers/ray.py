"""Ray launcher: the same role loops as Ray actors on a cluster.

Ray does what it is good at: placing processes on nodes (one placement group, a bundle per role),
starting and restarting them, and carrying small control messages (where a role runs, where the
learner listens, the run's keys). Samples and weights never go through Ray: they travel on
TianJi's own data plane, shared-memory slots when an actor and the learner share a node and
CURVE-encrypted ZeroMQ TCP between nodes. The driver stays the supervising process, as with the
local launcher (`tianji.runtime.driver.supervise`).

    tianji train cartpole-ppo --launcher ray                  # a Ray instance for this run only
    tianji train cartpole-ppo --launcher ray --address auto   # the cluster `ray start --head` made
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from tianji.config import Config, ConfigError, build_config
from tianji.runtime.driver.checkpoint import ShippedStore, restore_path
from tianji.runtime.driver.context import RunContext
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.driver.supervise import RoleError, drive, is_learner
from tianji.runtime.roles.loops import actor_loop, bind_learner, evaluator_loop, learner_loop, learner_of, run_role
from tianji.runtime.sync import GroupSpec, rendezvous_store
from tianji.runtime.transport.links import (
    ControlChannel,
    Endpoints,
    bound_endpoint,
    log,
    new_token,
    socket,
    sweep_leftovers,
)
from tianji.runtime.transport.security import CurveKeys, Gatekeeper

ANY_INTERFACE = "0.0.0.0"
LOOPBACK = "127.0.0.1"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray: pip install 'tianji[ray]'") from None
    return ray


def _run_to_json(run: RunContext) -> str:
    return json.dumps({"config": run.cfg.model_dump(mode="json"), "run_dir": str(run.run_dir), "t0": run.t0,
                       "resumed": run.resumed})


def _run_from_json(text: str) -> RunContext:
    raw = json.loads(text)
    return RunContext(build_config(raw["config"]), Path(raw["run_dir"]), raw["t0"], raw["resumed"])


class RoleHost:
    """One role inside a Ray actor process: says where it runs, binds (a learner), runs its loop.
    Everything it receives is plain text or bytes (JSON, keys, a checkpoint), never objects."""

    def __init__(self, name: str, run_json: str, token: str):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        self.name, self.run, self.token = name, _run_from_json(run_json), token
        self.learner_ctx: zmq.Context | None = None
        self.sockets = None
        self.group_store = None
        sweep_leftovers()  # slot files and sockets of dead runs on this node

    def where(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def bind(self, endpoints_json: str, all_interfaces: bool) -> dict[str, Any]:
        """A learner listens on this node's cluster address at free ports; returns where. Rank 0 of a
        group also opens the group's rendezvous (torch.distributed's TCP store)."""
        import ray

        ip = ray.util.get_node_ip_address()
        host = ANY_INTERFACE if all_interfaces else ip
        endpoints = replace(Endpoints.from_dict(json.loads(endpoints_json)),
                            fragments=f"tcp://{host}:*", weights=f"tcp://{host}:*")
        self.learner_ctx = zmq.Context()
        self.sockets = bind_learner(self.learner_ctx, endpoints)
        where: dict[str, Any] = {k: v.replace(ANY_INTERFACE, ip) for k, v in self.sockets.endpoints.items()}
        learners = int(self.run.cfg.topology.learners)
        if self.name == "learner0" and learners > 1:
            self.group_store = rendezvous_store(GroupSpec(0, learners, ip, 0, self.run.cfg.sync.timeout_s))
            where["group"] = {"host": ip, "port": self.group_store.port}
        return where

    def run(self, wiring_json: str, restore: bytes | None = None) -> None:
        wiring = json.loads(wiring_json)
        endpoints = Endpoints.from_dict(wiring["endpoints"])
        run, topology = self.run, self.run.cfg.topology
        if is_learner(self.name):
            rank = int(self.name[len("learner"):])
            group = wiring.get("group")
            spec = None if group is None else GroupSpec(rank, int(topology.learners), group["host"], group["port"],
                                                        run.cfg.sync.timeout_s)

            def loop(ctx: zmq.Context, events: zmq.Socket, driver: Any) -> None:
                learner_loop(run, self.token, wiring["epoch"], self.sockets, ShippedStore(restore, rank), events,
                             driver, rank, spec, self.group_store)

            run_role(self.name, run, topology.learner_threads, endpoints, loop, ctx=self.learner_ctx,
                     own_process=False)
        elif self.name == "evaluator":
            run_role(self.name, run, 1, endpoints,
                     lambda ctx, events, driver: evaluator_loop(run, endpoints, ctx, events, driver), own_process=False)
        else:
            actor_id = int(self.name[len("actor"):])
            run_role(self.name, run, topology.actor_threads, endpoints,
                     lambda ctx, events, driver: actor_loop(run, endpoints, self.token, actor_id, ctx, events, driver,
                                                            same_machine=wiring["same_machine"]),
                     own_process=False)


def bundles(cfg: Config, share: float = 1.0) -> dict[str, dict[str, float]]:
    """One placement-group bundle per role: `share` CPUs per thread plus the custom resources that pin it."""
    r = cfg.ray
    out = {}
    for rank in range(int(cfg.topology.learners)):
        out[f"learner{rank}"] = {"CPU": share * cfg.topology.learner_threads, **r.learner_resources}
        if r.learner_gpus:
            out[f"learner{rank}"]["GPU"] = r.learner_gpus
    for i in range(int(cfg.topology.actors)):
        out[f"actor{i}"] = {"CPU": share * cfg.topology.actor_threads, **r.actor_resources}
    if cfg.eval.interval_s is not None:
        out["evaluator"] = {"CPU": share, **r.evaluator_resources}
    return out


def cpu_share(cfg: Config, cluster_cpus: float) -> float:
    """CPUs per role thread: `ray.role_cpus`, or under auto 1 where the cluster has a CPU for every role
    thread and else the share that fits (rounded down to Ray's resource precision)."""
    if cfg.ray.role_cpus != "auto":
        return float(cfg.ray.role_cpus)
    threads = sum(b["CPU"] for b in bundles(cfg).values())
    return 1.0 if cluster_cpus >= threads else math.floor(10_000 * cluster_cpus / threads) / 10_000


def unplaceable(wanted: dict[str, dict[str, float]], nodes: list[dict[str, float]]) -> list[str]:
    """Why the cluster (`nodes`: each alive node's total resources) can never hold these bundles, even idle:
    a bundle no single node can hold, or more of a resource than the cluster has. Empty when it can."""
    problems = [f"{name} asks {bundle}, more than any node has ({_largest(nodes, bundle)})"
                for name, bundle in wanted.items()
                if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes)]
    for resource in sorted({k for bundle in wanted.values() for k in bundle}):
        asked, has = sum(b.get(resource, 0.0) for b in wanted.values()), sum(n.get(resource, 0.0) for n in nodes)
        if asked > has + 1e-9:
            problems.append(f"the roles ask {asked:g} {resource} in all, the cluster has {has:g}")
    return problems


def _largest(nodes: list[dict[str, float]], bundle: dict[str, float]) -> str:
    return ", ".join(f"{k} {max((n.get(k, 0.0) for n in nodes), default=0.0):g}" for k in bundle)


def node_resources(ray: Any) -> list[dict[str, float]]:
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


class RayRoles:
    """Roles as Ray actors in one placement group. Actors and the evaluator are restarted by Ray
    (max_restarts); the learners are replaced as a group by new Ray actors in their bundles, with
    the next epoch, resuming from the last checkpoint."""

    def __init__(self, ray: Any, run: RunContext, endpoints: Endpoints, token: str):
        from ray.util.placement_group import placement_group

        self.ray, self.run, self.token = ray, run, token
        self.endpoints = endpoints  # the driver's; the learners' are added once they have bound
        self.learner_epoch = 0
        nodes = node_resources(ray)
        self.bundles = bundles(run.cfg, cpu_share(run.cfg, sum(n.get("CPU", 0.0) for n in nodes)))
        problems = unplaceable(self.bundles, nodes)
        if problems:  # at once, rather than after ray.placement_timeout_s
            raise ConfigError("the Ray cluster can never place this run's roles: " + "; ".join(problems)
                              + " (ray.role_cpus, topology.*, ray.*_resources and ray.learner_gpus set what they ask)")
        self.learners = [name for name in self.bundles if is_learner(name)]
        self.handles: dict[str, Any] = {}
        self.refs: dict[str, Any] = {}
        self.places: dict[str, dict[str, Any]] = {}
        self.learner_at: dict[str, dict[str, Any]] = {}
        self._run_json = _run_to_json(run)
        self.pg = placement_group(list(self.bundles.values()), strategy=run.cfg.ray.strategy)
        try:
            self._wait_for_placement()
            _phase(run, "roles placed")
            for name in self.bundles:
                self.handles[name] = self._create(name)
            self._locate(list(self.bundles))
            _phase(run, "role processes up")
            self._bind_learners()
            for name in self.bundles:
                self._run(name)
            _phase(run, "roles running")
        except BaseException:
            self.stop_all()
            raise
        self._record()

    # ------------------------------------------------------------ Roles protocol
    def names(self) -> list[str]:
        return list(self.bundles)

    def alive(self, name: str) -> bool:
        ready, _ = self.ray.wait([self.refs[name]], timeout=0)
        return not ready

    def exitcode(self, name: str) -> int | str | None:
        if self.alive(name):
            return None
        try:
            self.ray.get(self.refs[name], timeout=0)
            return 0
        except Exception as exc:  # RayActorError (process died), RayTaskError (the loop raised)
            return type(exc).__name__

    def restart(self, name: str) -> None:
        if self.alive(name):  # silent, not dead: kill it, Ray starts it again
            self.ray.kill(self.handles[name], no_restart=False)
        self._locate([name])  # waits until Ray has restarted the process
        self._run(name)
        self._record()

    def restart_learners(self) -> None:
        """New Ray actors in the learners' bundles; they resume from the checkpoint."""
        for name in self.learners:
            self.ray.kill(self.handles[name], no_restart=True)
        self.learner_epoch += 1
        for name in self.learners:
            self.handles[name] = self._create(name)
        self._locate(self.learners)
        self._bind_learners()
        for name in self.learners:
            self._run(name)
        self._record()

    def learner_endpoints(self) -> list[dict[str, str]]:
        return [{k: v for k, v in self.learner_at[name].items() if k != "group"} for name in self.learners]

    def stop_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for handle in self.handles.values():
            self.ray.kill(handle, no_restart=True)
        remove_placement_group(self.pg)

    # ------------------------------------------------------------ placement and start
    def _wait_for_placement(self) -> None:
        ready, _ = self.ray.wait([self.pg.ready()], timeout=self.run.cfg.ray.placement_timeout_s)
        if not ready:
            raise RoleError(f"the Ray cluster could not place the run's roles within "
                            f"{self.run.cfg.ray.placement_timeout_s:.0f} s: bundles {self.bundles} "
                            f"({self.run.cfg.ray.strategy}), cluster resources {self.ray.cluster_resources()}")

    def _create(self, name: str) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[name]
        options = {
            "num_cpus": bundle["CPU"],
            "num_gpus": bundle.get("GPU", 0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=list(self.bundles).index(name)),
            "max_restarts": 0 if is_learner(name) else self.run.cfg.supervision.max_actor_restarts,
            "max_task_retries": 0,  # a failed loop is reported to the driver, which starts it again
        }
        return self.ray.remote(RoleHost).options(**options).remote(name, self._run_json, self.token)

    def _locate(self, names: list[str]) -> None:
        """Ask each role where it runs; waits while Ray (re)starts its process. A role created in a bundle
        whose node has just died is created again once Ray has moved the bundle to a live node."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        deadline = time.time() + self.run.cfg.ray.placement_timeout_s
        for name in names:
            while True:
                try:
                    place = self.ray.get(self.handles[name].where.remote(), timeout=max(1.0, deadline - time.time()))
                    break
                except (ActorUnavailableError, ActorDiedError) as exc:  # restarting, or lost with its node
                    if time.time() > deadline:
                        raise RoleError(f"{name} did not come back within {self.run.cfg.ray.placement_timeout_s:.0f} s")
                    time.sleep(0.5)
                    if isinstance(exc, ActorDiedError):
                        log.warning("%s was lost with its node; creating it again", name)
                        self.handles[name] = self._create(name)
            self.places[name] = place
            log.info("%s runs on node %s (%s), pid %d", name, place["node"][:12], place["ip"], place["pid"])

    def _bind_learners(self) -> None:
        endpoints = json.dumps(self.endpoints.as_dict())
        binds = [self.handles[name].bind.remote(endpoints, self.run.cfg.ray.bind_all_interfaces)
                 for name in self.learners]
        places = self.ray.get(binds, timeout=self.run.cfg.ray.placement_timeout_s)
        self.learner_at = dict(zip(self.learners, places))

    def _learner_of(self, name: str) -> str:
        if is_learner(name):
            return name
        actor = int(name[len("actor"):]) if name.startswith("actor") else 0
        return f"learner{learner_of(self.run.cfg, actor)}"

    def _run(self, name: str) -> None:
        learner = self._learner_of(name)
        at = self.learner_at[learner]
        wiring = {"endpoints": replace(self.endpoints, fragments=at["fragments"], weights=at["weights"]).as_dict(),
                  "epoch": self.learner_epoch, "group": self.learner_at[self.learners[0]].get("group"),
                  "same_machine": self.places[name]["node"] == self.places[learner]["node"]}
        restore = self._restore(int(name[len("learner"):])) if is_learner(name) else None
        self.refs[name] = self.handles[name].run.remote(json.dumps(wiring), restore)

    def _restore(self, rank: int) -> bytes | None:
        """The checkpoint a (re)started learner resumes from: it may run on another machine."""
        if not (self.run.resumed or self.learner_epoch > 0):
            return None
        path = restore_path(self.run.checkpoint_dir, rank, restart=self.learner_epoch > 0)
        return None if path is None else path.read_bytes()

    def _record(self) -> None:
        """roles.json (pids) and placement.json (node, address and pid of every role)."""
        (self.run.run_dir / "roles.json").write_text(json.dumps({n: p["pid"] for n, p in self.places.items()}))
        (self.run.run_dir / "placement.json").write_text(json.dumps(self.places, indent=2))


def _phase(run: RunContext, what: str) -> None:
    log.info("ray launcher: %s at %.2f s", what, time.time() - run.t0)


def loopback_only(ray: Any) -> None:
    """A Ray instance for this machine alone: Ray's processes and every TianJi socket on loopback.
    (Ray otherwise swaps 127.0.0.1 for the machine's network address; this switch is how it lets a
    single machine keep to loopback, in this process and the Ray processes it starts.)"""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def _start_or_join(ray: Any, cfg: Config) -> bool:
    """Join `ray.address`, or start a Ray instance for this run; True when started here (to shut down)."""
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "runtime_env": cfg.ray.runtime_env or None}
    if cfg.ray.address is None:
        needed = sum(b["CPU"] for b in bundles(cfg).values())
        loopback_only(ray)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), _node_ip_address=LOOPBACK,
                 **options)
    else:
        address = _resolve_address(cfg.ray.address)
        if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]"):
            loopback_only(ray)  # a cluster started on loopback (`ray start --head --node-ip-address=127.0.0.1`)
        ray.init(address=address, **options)
    return True


def _resolve_address(address: str) -> str:
    """'auto' names the cluster `ray start` recorded on this machine (or RAY_ADDRESS)."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or address
    except Exception:  # Ray's internals moved: let ray.init resolve it
        return address


def run_ray(run: RunContext, monitor: Monitor) -> str:
    """Place the roles on the Ray cluster, supervise them until a stop condition, stop them cleanly."""
    ray = import_ray()
    cfg = run.cfg
    started_here = _start_or_join(ray, cfg)
    _phase(run, "joined Ray" if not started_here or cfg.ray.address is not None else "started Ray")
    keys = CurveKeys.new()
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    ip = ray.util.get_node_ip_address()
    host = ANY_INTERFACE if cfg.ray.bind_all_interfaces else ip
    control = None
    try:
        events = socket(ctx, zmq.PULL, f"tcp://{host}:*", bind=True, keys=keys)
        control = ControlChannel(ctx, f"tcp://{host}:*", keys)
        endpoints = Endpoints("", "", bound_endpoint(events).replace(ANY_INTERFACE, ip),
                              control.endpoint.replace(ANY_INTERFACE, ip), keys)
        roles = RayRoles(ray, run, endpoints, new_token())
        reason = drive(run, monitor, events, control, roles)
        monitor.count("refused_peers", gate.refused)
        return reason
    finally:
        if control is not None:
            control.close()
        gate.stop()
        ctx.destroy(linger=0)
        if started_here:
            ray.shutdown()
