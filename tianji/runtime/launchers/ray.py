"""Ray launcher: the same role loops as processes on a Ray cluster.

Ray does what it is good at: placing work on nodes (one placement group, a bundle per role),
telling where each bundle landed, noticing lost nodes, and carrying small control messages (where
a role runs, the run's keys, a checkpoint to resume from). On each node one Ray actor, a node host
(`tianji.runtime.process.host`), starts that node's roles from a zygote that imported the role code
once, so a node pays one torch import, not one per role. Samples and weights never go through Ray:
they travel on TianJi's own data plane, shared-memory slots when an actor and the learner share a
node and CURVE-encrypted ZeroMQ TCP between nodes. The driver stays the supervising process, as
with the local launcher (`tianji.runtime.driver.supervise`).

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
from tianji.runtime.driver.control import ControlChannel
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.driver.supervise import RoleError, drive, is_learner
from tianji.runtime.launchers.ray_boot import ROLE_CODE, ROLE_PROCESS, Booted, RayNodeHost, booted
from tianji.runtime.process.life import new_token, sweep_leftovers
from tianji.runtime.roles.loops import actor_loop, bind_learner, evaluator_loop, learner_loop, run_role
from tianji.runtime.roles.service import learner_of
from tianji.runtime.shared.checkpoint import CheckpointSets, ShippedStore
from tianji.runtime.shared.context import RunContext
from tianji.runtime.shared.logs import log
from tianji.runtime.sync import GroupSpec, probe_group
from tianji.runtime.transport.security import CurveKeys, Gatekeeper
from tianji.runtime.transport.sockets import Endpoints, bound_endpoint, socket

ANY_INTERFACE = "0.0.0.0"
POLL_INTERVAL_S = 0.25  # how often the driver asks the hosts which roles ended
STOP_HOSTS_S = 10.0  # how long the end of a run waits for the hosts to leave their nodes clean


def _run_to_json(run: RunContext) -> str:
    return json.dumps(
        {"config": run.cfg.model_dump(mode="json"), "run_dir": str(run.run_dir), "t0": run.t0, "resumed": run.resumed}
    )


def _run_from_json(text: str) -> RunContext:
    raw = json.loads(text)
    return RunContext(build_config(raw["config"]), Path(raw["run_dir"]), raw["t0"], raw["resumed"])


def role_process(spec: dict[str, Any]) -> None:
    """Body of a role process a node host forked. Everything it gets is plain JSON: the run, its
    name, where to listen or connect, the run's keys; a learner also the path of the checkpoint it
    resumes from (the host wrote the bytes the driver sent)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sweep_leftovers()  # slot files and sockets of dead runs on this node
    name, run, token = spec["name"], _run_from_json(spec["run"]), spec["token"]
    endpoints, topology = Endpoints.from_dict(spec["endpoints"]), run.cfg.topology
    parent = os.getppid()  # the zygote: a role dies with it
    if is_learner(name):
        rank = int(name[len("learner") :])
        group = spec["group"]
        group_spec = (
            None
            if group is None
            else GroupSpec(
                rank,
                topology.learner_count,
                group["host"],
                group["port"],
                run.cfg.sync.timeout_s,
                listen_host=ANY_INTERFACE if run.cfg.ray.bind_all_interfaces else None,
            )
        )
        restore = _read_once(spec.get("attachment"))
        listen = replace(endpoints, fragments=spec["listen"]["fragments"], weights=spec["listen"]["weights"])

        def loop(ctx: zmq.Context, events: zmq.Socket, driver: Any) -> None:
            learner_loop(
                run,
                token,
                spec["epoch"],
                bind_learner(ctx, listen),
                ShippedStore(restore, rank, spec["epoch"]),
                events,
                driver,
                rank,
                group_spec,
            )

        run_role(name, run, topology.learner_threads, endpoints, loop, driver_pid=parent)
    elif name == "evaluator":
        run_role(
            name,
            run,
            1,
            endpoints,
            lambda ctx, events, driver: evaluator_loop(run, endpoints, ctx, events, driver),
            driver_pid=parent,
            nice=topology.actor_nice,
        )
    else:
        actor_id = int(name[len("actor") :])
        run_role(
            name,
            run,
            topology.actor_threads,
            endpoints,
            lambda ctx, events, driver: actor_loop(
                run, endpoints, token, actor_id, ctx, events, driver, same_machine=spec["same_machine"]
            ),
            driver_pid=parent,
            nice=topology.actor_nice,
        )


def _read_once(path: str | None) -> bytes | None:
    if path is None:
        return None
    data = Path(path).read_bytes()
    Path(path).unlink(missing_ok=True)
    return data


def bundles(cfg: Config, share: float = 1.0) -> dict[str, dict[str, float]]:
    """One placement-group bundle per role: `share` CPUs per thread plus the custom resources that pin it."""
    r = cfg.ray
    out = {}
    for rank in range(cfg.topology.learner_count):
        out[f"learner{rank}"] = {"CPU": share * cfg.topology.learner_threads, **r.learner_resources}
        if r.learner_gpus:
            out[f"learner{rank}"]["GPU"] = r.learner_gpus
    for i in range(cfg.topology.actor_count):
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
    problems = [
        f"{name} asks {bundle}, more than any node has ({_largest(nodes, bundle)})"
        for name, bundle in wanted.items()
        if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes)
    ]
    for resource in sorted({k for bundle in wanted.values() for k in bundle}):
        asked, has = sum(b.get(resource, 0.0) for b in wanted.values()), sum(n.get(resource, 0.0) for n in nodes)
        if asked > has + 1e-9:
            problems.append(f"the roles ask {asked:g} {resource} in all, the cluster has {has:g}")
    return problems


def _largest(nodes: list[dict[str, float]], bundle: dict[str, float]) -> str:
    return ", ".join(f"{k} {max((n.get(k, 0.0) for n in nodes), default=0.0):g}" for k in bundle)


def node_resources(ray: Any) -> list[dict[str, float]]:
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def measure_link(ray: Any, parameters: int, timeout_s: float = 120.0) -> dict[str, Any] | None:
    """The network between two nodes of the cluster, as a learner group would see it: one rank on
    each of the first two alive nodes forms a gloo group over TCP and runs the probe every learner
    group runs at start (`measure_group`, a bucket of `parameters` float32s). None on one node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [node for node in ray.nodes() if node.get("Alive")][:2]
    if len(alive) < 2:
        return None
    pinned = [NodeAffinitySchedulingStrategy(node["NodeID"], soft=False) for node in alive]
    host = alive[0]["NodeManagerAddress"]
    free_ports = ray.remote(RayNodeHost.free_ports).options(num_cpus=0, scheduling_strategy=pinned[0])
    (port,) = ray.get(free_ports.remote(host, 1), timeout=timeout_s)
    probe = ray.remote(probe_group)
    ranks = [
        probe.options(num_cpus=0, scheduling_strategy=where).remote(
            GroupSpec(rank, 2, host, port, timeout_s), parameters
        )
        for rank, where in enumerate(pinned)
    ]
    costs = ray.get(ranks, timeout=timeout_s)[0]
    return {**costs, "nodes": [node["NodeID"] for node in alive]}


class RayRoles:
    """Roles as processes of node hosts, one host (a Ray actor) per node the run's placement group
    uses. A role that dies is started again by its host; a host lost with its node is created again
    where Ray moves its bundles; the learners are replaced as a group, with the next epoch, from the
    last checkpoint."""

    def __init__(self, ray: Any, run: RunContext, endpoints: Endpoints, token: str, boot: Booted | None = None):
        from ray.util.placement_group import placement_group

        self.ray, self.run, self.token = ray, run, token
        self.endpoints = endpoints  # the driver's; each role also gets its learner's
        self.learner_epoch = 0
        nodes = node_resources(ray)
        self.bundles = bundles(run.cfg, cpu_share(run.cfg, sum(n.get("CPU", 0.0) for n in nodes)))
        problems = unplaceable(self.bundles, nodes)
        if problems:  # at once, rather than after ray.placement_timeout_s
            raise ConfigError(
                "the Ray cluster can never place this run's roles: "
                + "; ".join(problems)
                + " (ray.role_cpus, topology.*, ray.*_resources and ray.learner_gpus set what they ask)"
            )
        self.learners = [name for name in self.bundles if is_learner(name)]
        self.hosts: dict[str, Any] = {}  # node id -> its host
        self.host_ip: dict[str, str] = {}  # node id -> the node's address
        self.node_of: dict[str, str] = {}  # role -> node id of the host that runs it
        self.pids: dict[str, int] = {}
        self.places: dict[str, dict[str, Any]] = {}
        self.learner_at: dict[str, dict[str, Any]] = {}
        self._exits: dict[str, int | str] = {}  # roles known to have ended, and how
        self._polls: dict[str, Any] = {}  # node id -> pending exit-code query
        self._polled_at = 0.0
        self._lost: set[str] = set()  # nodes whose host is gone
        self._run_json = _run_to_json(run)
        self.pg = placement_group(list(self.bundles.values()), strategy=run.cfg.ray.strategy)
        try:
            self._wait_for_placement()
            _phase(run, "roles placed")
            self._place_hosts(boot)
            self._choose_learner_ports()
            self._start(list(self.bundles))
            _phase(run, "roles running")
        except BaseException:
            self.stop_all()
            raise
        self._record()

    # ------------------------------------------------------------ Roles protocol
    def names(self) -> list[str]:
        return list(self.bundles)

    def alive(self, name: str) -> bool:
        self._poll()
        return name not in self._exits

    def exitcode(self, name: str) -> int | str | None:
        return self._exits.get(name)

    def restart(self, name: str) -> None:
        self._rehost(name)
        self._start([name])
        self._record()

    def restart_learners(self) -> None:
        """New learner processes (on a new host if theirs was lost); they resume from the checkpoint."""
        for name in self.learners:
            self._rehost(name)
        self.learner_epoch += 1
        self._choose_learner_ports()
        self._start(self.learners)
        self._record()

    def learner_endpoints(self) -> list[dict[str, str]]:
        return [
            {k: v for k, v in self.learner_at[name].items() if k in ("fragments", "weights")} for name in self.learners
        ]

    def stop_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        # each host stops its node's roles and removes the run's slot files there (a role killed with
        # kill -9 during the run left its own); a host whose node is gone answers with an error, not at all
        closing = [handle.close_run.remote(self.token) for handle in self.hosts.values()]
        if closing:  # none when placement failed before any host started
            self.ray.wait(closing, num_returns=len(closing), timeout=STOP_HOSTS_S)
        for handle in self.hosts.values():  # its zygote, and the roles, die with it
            self.ray.kill(handle, no_restart=True)
        remove_placement_group(self.pg)

    # ------------------------------------------------------------ placement and start
    def _wait_for_placement(self) -> None:
        ready, _ = self.ray.wait([self.pg.ready()], timeout=self.run.cfg.ray.placement_timeout_s)
        if not ready:
            raise RoleError(
                f"the Ray cluster could not place the run's roles within "
                f"{self.run.cfg.ray.placement_timeout_s:.0f} s: bundles {self.bundles} "
                f"({self.run.cfg.ray.strategy}), cluster resources {self.ray.cluster_resources()}"
            )

    def _bundle_nodes(self) -> dict[str, str]:
        """role -> node id its bundle is on now."""
        from ray.util.placement_group import placement_group_table

        on = placement_group_table(self.pg).get("bundles_to_node_id", {})
        return {name: on.get(i) for i, name in enumerate(self.bundles) if on.get(i)}

    def _place_hosts(self, boot: Booted | None) -> None:
        """One host per node, in the first bundle placed there (a learner's first: it may hold the GPU).
        The warm host (on the driver's node) serves that node when it can: no GPU there (its zygote has
        the command's environment, not what Ray gives a GPU worker), no ray.runtime_env."""
        on = self._bundle_nodes()
        if boot is not None and boot.warm_host is not None:
            warm_node = self.ray.get(boot.warm_host.where.remote())["node"]
            gpu_there = any(self.bundles[n].get("GPU") for n, node in on.items() if node == warm_node)
            if gpu_there or self.run.cfg.ray.runtime_env or warm_node not in on.values():
                self.ray.kill(boot.warm_host, no_restart=True)
                boot.close()
            else:
                self.hosts[warm_node] = boot.warm_host
        for name in self.bundles:
            if on[name] not in self.hosts:
                self.hosts[on[name]] = self._new_host(name)
            self.node_of[name] = on[name]
        self._locate_hosts(list(self.hosts))

    def _new_host(self, name: str) -> Any:
        """A host in `name`'s bundle, holding what the bundle holds (so a GPU is visible to its roles)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[name]
        return (
            self.ray.remote(RayNodeHost)
            .options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=list(self.bundles).index(name)
                ),
                runtime_env=self.run.cfg.ray.runtime_env or None,
                max_restarts=0,
                max_task_retries=0,
            )
            .remote(ROLE_CODE)
        )

    def _locate_hosts(self, nodes: list[str]) -> None:
        for node in nodes:
            where = self.ray.get(self.hosts[node].where.remote(), timeout=self.run.cfg.ray.placement_timeout_s)
            if where["node"] != node:
                raise RoleError(f"a node host meant for node {node[:12]} runs on {where['node'][:12]}")
            self.host_ip[node] = where["ip"]
        _phase(self.run, "node hosts up")

    def _rehost(self, name: str) -> None:
        """Before `name` starts again: if its host was lost with its node, find or make the host of the
        node its bundle was moved to (Ray re-places a lost node's bundles on the nodes left)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        if self.node_of[name] not in self._lost:
            return
        deadline = time.time() + self.run.cfg.ray.placement_timeout_s
        while True:
            node = self._bundle_nodes().get(name)
            if node is not None and node in self.hosts and node not in self._lost:
                break
            handle = self._new_host(name)  # Ray starts it once the bundle has a live node
            try:
                node = self.ray.get(handle.where.remote(), timeout=max(1.0, deadline - time.time()))["node"]
            except (ActorDiedError, ActorUnavailableError):
                if time.time() > deadline:
                    raise RoleError(
                        f"{name}'s bundle found no live node within {self.run.cfg.ray.placement_timeout_s:.0f} s"
                    ) from None
                time.sleep(0.5)
                continue
            self.hosts[node] = handle
            self._lost.discard(node)
            self._locate_hosts([node])
            break
        log.warning("%s was lost with its node; it starts again on node %s", name, node[:12])
        self.node_of[name] = node

    def _choose_learner_ports(self) -> None:
        """Each learner listens at ports its host found free on its node; rank 0 also opens the group's
        rendezvous. Known before any role starts, so every role starts at once."""
        for rank, name in enumerate(self.learners):
            node = self.node_of[name]
            ip = self.host_ip[node]
            ports = self.ray.get(self.hosts[node].free_ports.remote(ip, 3 if rank == 0 else 2))
            self.learner_at[name] = {"fragments": f"tcp://{ip}:{ports[0]}", "weights": f"tcp://{ip}:{ports[1]}"}
            if rank == 0 and len(self.learners) > 1:
                self.learner_at[name]["group"] = {"host": ip, "port": ports[2]}

    def _learner_of(self, name: str) -> str:
        if is_learner(name):
            return name
        actor = int(name[len("actor") :]) if name.startswith("actor") else 0
        return f"learner{learner_of(self.run.cfg, actor)}"

    def _spec(self, name: str) -> dict[str, Any]:
        learner = self._learner_of(name)
        at = self.learner_at[learner]
        bind_host = ANY_INTERFACE if self.run.cfg.ray.bind_all_interfaces else self.host_ip[self.node_of[learner]]
        return {
            "name": name,
            "run": self._run_json,
            "token": self.token,
            "epoch": self.learner_epoch,
            "endpoints": replace(self.endpoints, fragments=at["fragments"], weights=at["weights"]).as_dict(),
            "listen": {
                k: at[k].replace(self.host_ip[self.node_of[learner]], bind_host) for k in ("fragments", "weights")
            },
            "group": self.learner_at[self.learners[0]].get("group"),
            "same_machine": self.node_of[name] == self.node_of[learner],
        }

    def _start(self, names: list[str]) -> None:
        """Ask the hosts to start these roles (all at once: a host starts its roles in turn)."""
        calls = {}
        for name in names:
            restore = self._restore(int(name[len("learner") :])) if is_learner(name) else None
            calls[name] = self.hosts[self.node_of[name]].start.remote(name, ROLE_PROCESS, self._spec(name), restore)
        for name, call in calls.items():
            self.pids[name] = self.ray.get(call, timeout=self.run.cfg.ray.placement_timeout_s)
            self._exits.pop(name, None)
            node = self.node_of[name]
            self.places[name] = {"pid": self.pids[name], "node": node, "ip": self.host_ip[node]}
            log.info("%s runs on node %s (%s), pid %d", name, node[:12], self.host_ip[node], self.pids[name])

    def _poll(self) -> None:
        """Collect the hosts' answers to "which of your roles ended?" without waiting, and ask again.
        A host that cannot answer was lost (with its node): its roles ended with it."""
        from ray.exceptions import RayActorError

        if time.time() - self._polled_at < POLL_INTERVAL_S:
            return
        self._polled_at = time.time()
        for node, host in self.hosts.items():
            if node in self._lost:
                continue
            pending = self._polls.get(node)
            if pending is None:
                self._polls[node] = host.exitcodes.remote()
                continue
            if not self.ray.wait([pending], timeout=0)[0]:
                continue
            del self._polls[node]
            try:
                codes = self.ray.get(pending)
            except RayActorError:
                self._lost.add(node)
                self._exits.update({n: "node host lost" for n, at in self.node_of.items() if at == node})
                continue
            for name, (pid, code) in codes.items():
                if code is not None and pid == self.pids.get(name):  # not an answer about a replaced process
                    self._exits[name] = code

    def _restore(self, rank: int) -> bytes | None:
        """The checkpoint a (re)started learner resumes from: it may run on another machine."""
        if not (self.run.resumed or self.learner_epoch > 0):
            return None
        good = CheckpointSets(self.run.checkpoint_dir).find_good()
        path = None if good is None else good.learner_path(rank, restart=self.learner_epoch > 0)
        return None if path is None else path.read_bytes()

    def _record(self) -> None:
        """roles.json (pids) and placement.json (node, address and pid of every role)."""
        (self.run.run_dir / "roles.json").write_text(json.dumps(self.pids))
        (self.run.run_dir / "placement.json").write_text(json.dumps(self.places, indent=2))


def _phase(run: RunContext, what: str) -> None:
    log.info("ray launcher: %s at %.2f s", what, time.time() - run.t0)


def run_ray(run: RunContext, monitor: Monitor) -> str:
    """Place the roles on the Ray cluster, supervise them until a stop condition, stop them cleanly."""
    cfg = run.cfg
    boot = booted(cfg.ray.address)
    ray = boot.ray
    _phase(run, "started Ray" if boot.started_here and cfg.ray.address is None else "joined Ray")
    keys = CurveKeys.new()
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    ip = ray.util.get_node_ip_address()
    host = ANY_INTERFACE if cfg.ray.bind_all_interfaces else ip
    control = None
    try:
        events = socket(ctx, zmq.PULL, f"tcp://{host}:*", bind=True, keys=keys)
        control = ControlChannel(ctx, f"tcp://{host}:*", keys)
        endpoints = Endpoints(
            "", "", bound_endpoint(events).replace(ANY_INTERFACE, ip), control.endpoint.replace(ANY_INTERFACE, ip), keys
        )
        roles = RayRoles(ray, run, endpoints, new_token(), boot)
        reason = drive(run, monitor, events, control, roles)
        monitor.count("refused_peers", gate.refused)
        return reason
    finally:
        if control is not None:
            control.close()
        gate.stop()
        ctx.destroy(linger=0)
        if boot.started_here:
            ray.shutdown()
        boot.close()
