"""Joining or starting Ray, and the node hosts the Ray launcher starts roles from. No torch here:
`tianji train --launcher ray` first starts this machine's zygote (it imports the role code at once),
then boots Ray and creates a warm host here that drives that zygote, and only then imports the
rest: the zygote's import overlaps Ray's start and the command's own imports.

    booted = boot("auto", Zygote(ROLE_CODE))   # booted.ray, booted.started_here, booted.warm_host
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tianji.runtime.process.host import NodeHost, Zygote
from tianji.runtime.transport.shm import remove_pools
from tianji.sections import ConfigError

LOOPBACK = "127.0.0.1"
ROLE_CODE = ["tianji.runtime.launchers.ray"]  # what a zygote imports: every role's code
ROLE_PROCESS = "tianji.runtime.launchers.ray:role_process"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray: pip install 'tianji[ray]'") from None
    return ray


class RayNodeHost(NodeHost):
    """A node host as a Ray actor: it also says where it runs, and at the run's end leaves its node clean."""

    def close_run(self, token: str) -> None:
        """Stop this node's roles and remove the run's slot files here, those of roles killed before
        (a kill -9 leaves its files; the local launcher removes them at its end the same way)."""
        self.close()
        remove_pools(token)

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host_pid": os.getpid(),
        }


def loopback_only(ray: Any) -> None:
    """A Ray instance for this machine alone: Ray's processes and every TianJi socket on loopback.
    (Ray otherwise swaps 127.0.0.1 for the machine's network address; this switch is how it lets a
    single machine keep to loopback, in this process and the Ray processes it starts.)"""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def resolve_address(address: str) -> str:
    """'auto' names the cluster `ray start` recorded on this machine (or RAY_ADDRESS)."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or address
    except Exception:  # Ray's internals moved: let ray.init resolve it
        return address


def start_or_join(ray: Any, address: str | None) -> bool:
    """Join `address`, or start a Ray instance of this machine's CPUs for this run; True when started
    here (to shut down). Already connected (a test's cluster, a notebook): nothing to do."""
    if ray.is_initialized():
        return False
    if address is None:
        loopback_only(ray)
        ray.init(address="local", num_cpus=os.cpu_count() or 1, _node_ip_address=LOOPBACK, include_dashboard=False)
    else:
        address = resolve_address(address)
        if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]"):
            loopback_only(ray)  # a cluster started on loopback (`ray start --head --node-ip-address=127.0.0.1`)
        ray.init(address=address, include_dashboard=False)
    return True


def warm_host(ray: Any, zygote: Zygote) -> Any:
    """A node host on the driver's machine that drives the zygote the command started, outside the
    run's placement group (it reserves nothing: the roles' bundles do)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return (
        ray.remote(RayNodeHost)
        .options(num_cpus=0, scheduling_strategy=here, max_restarts=0)
        .remote(ROLE_CODE, zygote.path)
    )


@dataclass
class Booted:
    ray: Any
    address: str | None  # as asked: None for an instance of this run's own
    started_here: bool
    warm_host: Any | None
    zygote: Zygote | None  # the warm host's, started by this process

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()


def boot(address: str | None, zygote: Zygote | None = None) -> Booted:
    """Join `address` or start Ray, from the main thread (the Ray processes it starts are tied to the
    thread that started them); with a `zygote` of this machine, also the warm host that drives it."""
    ray = import_ray()
    started = start_or_join(ray, address)
    if zygote is not None and not started:
        zygote.close()
        zygote = None
    return Booted(ray, address, started, None if zygote is None else warm_host(ray, zygote), zygote)


_early: Booted | None = None


def boot_early(address: str | None) -> None:
    """The command asked for --launcher ray: start this machine's zygote, then boot Ray, before the
    command's heavy imports; `booted` picks it up."""
    global _early
    _early = boot(address, Zygote(ROLE_CODE))


def booted(address: str | None) -> Booted:
    """Ray for a run that asks for `address`: the early boot when it went to the same place, else now."""
    global _early
    early, _early = _early, None
    if early is not None:
        if early.address == address:
            return early
        early.close()
        if early.started_here:  # the config named another cluster than the command line
            early.ray.shutdown()
    return boot(address)
