"""Several learners kept in step through torch.distributed (gloo on CPU, NCCL on CUDA): no root
process, no central buffer. The sync code sees parameters and gradients, never losses.

    group = join_group(GroupSpec(rank, world_size, host, port, timeout_s=60))
    sync = make_sync(cfg.sync, world_size)   # NoSync for one learner
    ... inside an algorithm's update, after backward():  sync.gradients(params)
    ... after every update, in the runtime:                sync.after_update(params, moments)
    ... when the driver asks to stop:                       sync.stop()

Modes:
- `allreduce`: gradients averaged across learners at every optimizer step, one bucketed all_reduce
  per step; every learner applies the same averaged gradient, so weights stay identical (the
  synchronous, strict dependency).
- `average` every k updates: each learner trains on its own; every k updates its parameters (and,
  with `sync.average_optimizer`, its Adam moments) are averaged by an asynchronous all_reduce. The
  learner keeps training while it is in flight and, when it completes, takes the average plus
  the progress it made meanwhile (the relaxed dependency).

Every collective is one flat float tensor whose first element is a stop flag, so stopping is
itself a collective: a learner that must stop sends the flag with its next collective, and every
learner leaves after the first collective that carries it. Collectives time out
(`sync.timeout_s`), so a dead peer fails the group instead of hanging it; the driver then
restarts the group from the last checkpoint.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


class GroupStopping(Exception):
    """A learner of the group is stopping: every learner stops after this collective."""


@dataclass(frozen=True)
class GroupSpec:
    rank: int
    world_size: int
    host: str  # where rank 0's rendezvous store is reached
    port: int
    timeout_s: float = 60.0
    backend: str = "gloo"
    listen_host: str | None = None  # the address rank 0's store binds (None: `host`; "0.0.0.0": every interface)


def rendezvous_store(spec: GroupSpec) -> dist.TCPStore:
    """Rank 0 listens (port 0: a free one, see `.port`); the others connect. Rank 0's store listens on
    `spec.host` only (torch's own would listen on every interface), through a socket bound here."""
    listen_fd = _listening_socket(spec.listen_host or spec.host, spec.port) if spec.rank == 0 else None
    return dist.TCPStore(
        spec.host,
        spec.port if listen_fd is None else _port_of(listen_fd),
        spec.world_size,
        is_master=spec.rank == 0,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _listening_socket(host: str, port: int) -> int:
    """A TCP socket listening on host:port, as a file descriptor the store takes over."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(128)
    return listener.detach()


def _port_of(fd: int) -> int:
    probe = socket.socket(fileno=os.dup(fd))
    try:
        return int(probe.getsockname()[1])
    finally:
        probe.close()


def join_group(spec: GroupSpec, store: dist.TCPStore | None = None) -> None:
    """Form the process group (blocks until every rank has joined or the timeout passes)."""
    if spec.host.startswith("127.") and spec.backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: keep the group on loopback
    dist.init_process_group(
        spec.backend,
        store=store or rendezvous_store(spec),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


BANDWIDTH_PROBE_FLOATS = 1 << 18  # 1 MiB of float32s


def measure_group(parameters: int, device: torch.device | str = "cpu", repeats: int = 20) -> dict[str, float]:
    """The group's collective costs, measured on every rank together (a collective itself): the mean
    time of an all_reduce of one number (latency) and of one gradient bucket (`parameters` float32s),
    and the bus bandwidth (from a bucket of at least 1 MiB: a ring moves 2 (L - 1) / L of it through
    each link). Means, not medians: gloo over TCP has a long tail (CartPole's 37 kB bucket on this
    machine: median 0.4 ms, mean 1.4 ms, one in ten over 4 ms), and training pays every one of them."""
    small, bucket = torch.zeros(1, device=device), torch.zeros(max(1, parameters), device=device)

    def mean_s(tensor: torch.Tensor) -> float:
        for _ in range(3):  # warm-up: connections, buffers
            dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    latency, full = mean_s(small), mean_s(bucket)
    # the bandwidth from at least 1 MiB: a small model's bucket takes hardly longer than one number,
    # and the difference of those two times would be mostly noise
    wide = bucket if bucket.numel() >= BANDWIDTH_PROBE_FLOATS else torch.zeros(BANDWIDTH_PROBE_FLOATS, device=device)
    wide_s = full if wide is bucket else mean_s(wide)
    world = dist.get_world_size()
    moved = 2 * (world - 1) / world * wide.element_size() * wide.numel()
    return {
        "allreduce_latency_s": latency,
        "allreduce_bucket_bytes": float(bucket.element_size() * bucket.numel()),
        "allreduce_bucket_s": full,
        "allreduce_bytes_per_s": moved / (wide_s - latency if wide_s > 2 * latency else wide_s),
    }


def probe_group(spec: GroupSpec, parameters: int) -> dict[str, float]:
    """Join the group `spec` names, run `measure_group` with every other rank, leave."""
    join_group(spec)
    try:
        return measure_group(parameters)
    finally:
        leave_group()


def broadcast_from_first(tensors: Sequence[torch.Tensor]) -> None:
    """Give every learner rank 0's tensors (the same start, also after a resume)."""
    flat = _flatten(tensors)
    dist.broadcast(flat, src=0)
    _unflatten(flat, tensors)


def _flatten(tensors: Sequence[torch.Tensor], flag: float | None = None) -> torch.Tensor:
    parts = [t.detach().reshape(-1).float() for t in tensors]
    device = parts[0].device if parts else torch.device("cpu")
    if flag is not None:
        parts.insert(0, torch.tensor([flag], device=device))
    return torch.cat(parts) if parts else torch.zeros(0)


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offset: int = 0) -> None:
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


class NoSync:
    """One learner: nothing to synchronise."""

    stopped = False
    world_size = 1
    averages = 0  # parameter averages applied

    def gradients(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def after_update(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        pass

    def started(self, params: Sequence[torch.Tensor]) -> None:
        """The group's common starting point (after rank 0's parameters were broadcast)."""

    def own_progress(self) -> float:
        """How far (max abs over parameters) this learner may have moved on its own since the group
        last agreed: 0 when the group never disagrees."""
        return 0.0

    def poll(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        pass

    def stop(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        pass


class GradientAllreduce(NoSync):
    """Average gradients at every optimizer step (call `gradients` between backward and the step)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.stopped = False

    def gradients(self, params: Sequence[torch.Tensor]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten(grads, flag=0.0)
        dist.all_reduce(flat)
        if flat[0] > 0:
            self.stopped = True
            raise GroupStopping("a learner of the group is stopping")
        flat[1:] /= self.world_size
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
        _unflatten(flat, [p.grad for p in params if p.grad is not None], offset=1)

    def stop(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        """Send the stop flag in a collective shaped like the others (zero gradients)."""
        if not self.stopped:
            self.stopped = True
            flat = _flatten([torch.zeros_like(p) for p in params], flag=1.0)
            dist.all_reduce(flat)


class ParameterAverage(NoSync):
    """Every `every` updates, average parameters (and moments, if `moments` are passed) asynchronously."""

    def __init__(self, world_size: int, every: int, average_optimizer: bool):
        self.world_size, self.every, self.average_optimizer = world_size, every, average_optimizer
        self.updates = 0
        self.averages = 0  # completed
        self.stopped = False
        self._work: dist.Work | None = None
        self._buffer: torch.Tensor | None = None
        self._snapshot: torch.Tensor | None = None
        # own progress, as the sum of each update's largest parameter change: since the last applied
        # average, and since the snapshot of the average in flight (what stays after it is applied)
        self._previous: torch.Tensor | None = None
        self._since_average = self._since_snapshot = 0.0

    def started(self, params: Sequence[torch.Tensor]) -> None:
        self._previous = _flatten(params)

    def own_progress(self) -> float:
        return self._since_average

    def _count_step(self, params: Sequence[torch.Tensor]) -> None:
        current = _flatten(params)
        if self._previous is not None:
            step = float((current - self._previous).abs().max())
            self._since_average += step
            self._since_snapshot += step
        self._previous = current

    def _tensors(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(params) + (list(moments) if self.average_optimizer else [])

    def after_update(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        self.updates += 1
        self._count_step(params)
        if self.updates % self.every == 0:
            if self._work is not None:  # at most one average in flight
                self._work.wait()
                self._apply(params, moments)
            self._launch(self._tensors(params, moments), flag=0.0)
        else:
            self.poll(params, moments)

    def poll(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        """Apply an average that has completed (between updates; the learner never waits for it)."""
        if self._work is not None and self._work.is_completed():
            self._apply(params, moments)

    def stop(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        if self.stopped:
            return
        if self._work is not None:
            self._work.wait()
            try:
                self._apply(params, moments)
            except GroupStopping:
                return
        self.stopped = True
        self._launch(self._tensors(params, moments), flag=1.0)
        if self._work is not None:
            self._work.wait()
        self._work = None

    def _launch(self, tensors: Sequence[torch.Tensor], flag: float) -> None:
        self._snapshot = _flatten(tensors)
        self._since_snapshot = 0.0
        self._buffer = torch.cat([torch.tensor([flag], device=self._snapshot.device), self._snapshot])
        self._work = dist.all_reduce(self._buffer, async_op=True)

    def _apply(self, params: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> None:
        """params <- average of the snapshots + what this learner learned since its snapshot."""
        buffer, snapshot, self._work = self._buffer, self._snapshot, None
        assert buffer is not None and snapshot is not None  # an average was launched
        if buffer[0] > 0:
            self.stopped = True
            raise GroupStopping("a learner of the group is stopping")
        tensors = self._tensors(params, moments)
        progress = _flatten(tensors) - snapshot
        _unflatten(buffer[1:] / self.world_size + progress, tensors)
        self.averages += 1
        self._since_average = self._since_snapshot  # the average is common; what was learned since is own
        self._previous = _flatten(params)


def make_sync(mode: str, world_size: int, every: int = 1, average_optimizer: bool = False) -> NoSync:
    if world_size == 1:
        return NoSync()
    if mode == "allreduce":
        return GradientAllreduce(world_size)
    return ParameterAverage(world_size, every, average_optimizer)
