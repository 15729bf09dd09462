"""Learner groups over torch.distributed (gloo, loopback): allreduce equals one learner on the union
batch, parameter averaging gives the mean, stop is a collective, and a dead peer fails fast."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time

import numpy as np
import pytest
import torch

from tianji.algos.common.optim import Adam
from tianji.runtime.sync import (
    GradientAllreduce,
    GroupSpec,
    GroupStopping,
    ParameterAverage,
    broadcast_from_first,
    join_group,
    leave_group,
)

STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def params_of(net) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in net.parameters()]


def run_ranks(body, port: int, world: int = 2, timeout_s: float = 20.0) -> list:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def main(rank: int) -> None:
        try:
            join_group(GroupSpec(rank, world, "127.0.0.1", port, timeout_s=timeout_s))
            results.put((rank, body(rank)))
        except Exception as exc:  # reported to the test
            results.put((rank, exc))
        finally:
            leave_group()

    processes = [ctx.Process(target=main, args=(rank,)) for rank in range(world)]
    for p in processes:
        p.start()
    out = dict(results.get(timeout=60) for _ in range(world))
    for p in processes:
        p.join(20)
    return [out[rank] for rank in range(world)]


def test_allreduce_learners_match_one_learner_on_the_union_batch():
    def body(rank):
        net = model()
        optimizer, sync = Adam(net.parameters(), lr=1e-2), GradientAllreduce(world_size=2)
        x, y = batch(rank)
        for _ in range(STEPS):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            sync.gradients(list(net.parameters()))
            optimizer.step()
        return params_of(net)

    ranks = run_ranks(body, free_port())
    union = model()
    optimizer = Adam(union.parameters(), lr=1e-2)
    x, y = (torch.cat(parts) for parts in zip(batch(0), batch(1), strict=True))
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(union(x), y).backward()
        optimizer.step()
    for a, b, ref in zip(ranks[0], ranks[1], params_of(union), strict=True):
        assert np.array_equal(a, b), "every learner applies the same averaged gradient: identical weights"
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)


def test_parameter_average_after_k_updates_is_the_mean_and_keeps_later_progress():
    k = 4

    def body(rank):
        net = model()
        optimizer, sync = (
            torch.optim.SGD(net.parameters(), lr=0.05),
            ParameterAverage(2, every=k, average_optimizer=False),
        )
        x, y = batch(rank)
        for _ in range(k):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            before = params_of(net)
            sync.after_update(list(net.parameters()), [])
        while sync.averages == 0:  # in flight: the learner could keep training meanwhile
            sync.poll(list(net.parameters()), [])
            time.sleep(0.01)
        return before, params_of(net)

    (before0, after0), (before1, after1) = run_ranks(body, free_port())
    for b0, b1, a0, a1 in zip(before0, before1, after0, after1, strict=True):
        np.testing.assert_allclose(a0, (b0 + b1) / 2, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a0, a1, rtol=1e-6, atol=1e-7)


def test_average_keeps_the_progress_made_while_it_was_in_flight():
    def body(rank):
        net = model()
        params = list(net.parameters())
        sync = ParameterAverage(2, every=1, average_optimizer=False)
        with torch.no_grad():
            params[0].add_(float(rank))  # learners apart by 1
        sync.after_update(params, [])  # the average of the snapshots is launched
        with torch.no_grad():
            params[0].add_(10.0)  # progress while it is in flight
        sync._work.wait()
        sync.poll(params, [])
        return params_of(net)[0]

    first, second = run_ranks(body, free_port())
    base = params_of(model())[0]
    np.testing.assert_allclose(first, base + 0.5 + 10.0, rtol=1e-6)
    np.testing.assert_allclose(second, base + 0.5 + 10.0, rtol=1e-6)


@pytest.mark.parametrize("mode", ["allreduce", "average"])
def test_stop_is_a_collective_every_learner_leaves_after_it(mode):
    def body(rank):
        net = model()
        params = list(net.parameters())
        sync = GradientAllreduce(2) if mode == "allreduce" else ParameterAverage(2, every=1, average_optimizer=False)
        if rank == 0:
            sync.stop(params, [])  # asked to stop first
            return "stopped"
        for _ in range(100):  # rank 1 keeps training until the flag reaches it
            try:
                if mode == "allreduce":
                    net(torch.ones(1, 4)).sum().backward()
                    sync.gradients(params)
                else:
                    sync.after_update(params, [])
                    time.sleep(0.01)
            except GroupStopping:
                return "saw the stop"
        return "never saw it"

    assert run_ranks(body, free_port()) == ["stopped", "saw the stop"]


def test_group_comes_up_and_down_and_a_dead_peer_fails_the_collective_within_the_timeout():
    port = free_port()

    def broadcast(rank):
        net = model()
        if rank == 1:
            with torch.no_grad():
                for p in net.parameters():
                    p.zero_()
        broadcast_from_first(list(net.parameters()))
        return params_of(net)

    first, second = run_ranks(broadcast, port)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)) and np.abs(first[0]).sum() > 0

    def dies(rank):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crashed learner
        started = time.time()
        try:
            torch.distributed.all_reduce(torch.ones(4))
        except Exception as exc:
            return ("raised", type(exc).__name__, time.time() - started)
        return ("completed", "", time.time() - started)

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def main(rank):
        join_group(GroupSpec(rank, 2, "127.0.0.1", port2, timeout_s=3.0))
        results.put(dies(rank))

    port2 = free_port()
    processes = [ctx.Process(target=main, args=(rank,)) for rank in range(2)]
    for p in processes:
        p.start()
    outcome = results.get(timeout=60)
    for p in processes:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert outcome[0] == "raised" and outcome[2] < 30, outcome
