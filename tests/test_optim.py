"""Our foreach Adam and RMSprop against torch.optim's and a NumPy reference; the schedule; the gradient step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from tianji.algos.common.optim import Adam, GradientStep, KLAdaptive, LinearDecay, RMSprop, lr_schedule, make_optimizer
from tianji.algos.common.settings import OptimizerConfig
from tianji.config import ConfigError, load_config
from tianji.runtime.roles.build import build_actor, build_learner


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize(
    "ours_cls, ref_cls, kwargs",
    [
        (Adam, torch.optim.Adam, {"lr": 3e-3, "eps": 1e-5}),
        (RMSprop, torch.optim.RMSprop, {"lr": 1e-3, "alpha": 0.99, "eps": 0.01, "momentum": 0.5}),
    ],
)
def test_matches_torch_optimizer_step_for_step(ours_cls, ref_cls, kwargs):
    ours_net, ref_net = make_net(0), make_net(0)
    ours, ref = ours_cls(ours_net.parameters(), **kwargs), ref_cls(ref_net.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        x = torch.randn(32, 5, generator=gen)
        for net, opt in ((ours_net, ours), (ref_net, ref)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours_net.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_continues_identically():
    net_a, net_b = make_net(0), make_net(0)
    opt_a = Adam(net_a.parameters(), lr=1e-2)
    x = torch.randn(8, 5)
    for _ in range(3):
        opt_a.zero_grad()
        net_a(x).sum().backward()
        opt_a.step()
    net_b.load_state_dict(net_a.state_dict())
    opt_b = Adam(net_b.parameters(), lr=1e-2)
    opt_b.load_state_dict(opt_a.state_dict())
    for net, opt in ((net_a, opt_a), (net_b, opt_b)):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    for a, b in zip(net_a.parameters(), net_b.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_does_not_import_dynamo():
    code = (
        "import sys, torch; from tianji.algos.common.optim import Adam; n = torch.nn.Linear(2, 2); "
        "o = Adam(n.parameters(), 0.1); n(torch.ones(1, 2)).sum().backward(); o.step(); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def rmsprop_reference(
    params: list[np.ndarray],
    grads_per_step: list[list[np.ndarray]],
    lr: float,
    alpha: float,
    eps: float,
    momentum: float,
) -> list[np.ndarray]:
    """RMSprop written out in NumPy (Tieleman & Hinton; torch.optim.RMSprop's non-centered form)."""
    params = [p.astype(np.float64).copy() for p in params]
    square = [np.zeros_like(p) for p in params]
    buffers = [np.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            square[i] = alpha * square[i] + (1 - alpha) * g * g
            step = g / (np.sqrt(square[i]) + eps)
            buffers[i] = momentum * buffers[i] + step
            params[i] -= lr * (buffers[i] if momentum > 0 else step)
    return params


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop_matches_numpy_reference(momentum):
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True),
    ]
    start = [p.detach().numpy().copy() for p in params]
    optimizer = RMSprop(params, lr=1e-2, alpha=0.95, eps=1e-3, momentum=momentum)
    history = []
    for _ in range(20):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        history.append([g.numpy() for g in grads])
    expected = rmsprop_reference(start, history, lr=1e-2, alpha=0.95, eps=1e-3, momentum=momentum)
    for p, e in zip(params, expected, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-10, atol=1e-12)


def tensorflow_rmsprop_reference(
    params: list[np.ndarray],
    grads_per_step: list[list[np.ndarray]],
    lr: float,
    alpha: float,
    eps: float,
    momentum: float,
) -> list[np.ndarray]:
    """tf.train.RMSPropOptimizer (TF 1, not centered) written out in NumPy: its `ms` slot starts at ones,
    eps sits inside the square root, momentum accumulates lr-scaled steps."""
    params = [p.astype(np.float64).copy() for p in params]
    ms = [np.ones_like(p) for p in params]
    mom = [np.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            ms[i] = alpha * ms[i] + (1 - alpha) * g * g
            mom[i] = momentum * mom[i] + lr * g / np.sqrt(ms[i] + eps)
            params[i] -= mom[i]
    return params


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_tensorflow_rmsprop_matches_numpy_reference(momentum):
    gen = torch.Generator().manual_seed(4)
    params = [
        torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True),
    ]
    start = [p.detach().numpy().copy() for p in params]
    optimizer = make_optimizer(
        params, OptimizerConfig(name="rmsprop_tf", alpha=0.95, eps=1e-3, momentum=momentum), lr=1e-2
    )
    history = []
    for _ in range(20):
        grads = [3 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        history.append([g.numpy() for g in grads])
    expected = tensorflow_rmsprop_reference(start, history, lr=1e-2, alpha=0.95, eps=1e-3, momentum=momentum)
    for p, e in zip(params, expected, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-10, atol=1e-12)


def test_tensorflow_rmsprop_damps_the_first_steps_that_pytorchs_takes_in_full():
    """The same small gradient: PyTorch's RMSprop moves 1 / sqrt(1 - alpha) = 10 lr at once, TF's about
    lr |g| (its average starts at 1)."""
    moved = {}
    for name in ("rmsprop", "rmsprop_tf"):
        param = torch.zeros(1, requires_grad=True)
        optimizer = make_optimizer([param], OptimizerConfig(name=name, eps=1e-10), lr=1.0)
        param.grad = torch.full((1,), 1e-3)
        optimizer.step()
        moved[name] = -float(param)
    assert moved["rmsprop"] == pytest.approx(10.0, rel=1e-3)
    assert moved["rmsprop_tf"] == pytest.approx(1e-3 / np.sqrt(0.99), rel=1e-6)


def test_make_optimizer_from_config_and_state_of_another_optimizer_is_refused():
    net = make_net(0)
    adam = make_optimizer(net.parameters(), OptimizerConfig(name="adam", eps=1e-5), lr=1e-3)
    rmsprop = make_optimizer(net.parameters(), OptimizerConfig(name="rmsprop", eps=0.01, alpha=0.9), lr=1e-3)
    assert isinstance(adam, Adam) and adam.eps == 1e-5
    assert isinstance(rmsprop, RMSprop) and (rmsprop.eps, rmsprop.alpha) == (0.01, 0.9)
    with pytest.raises(ValueError, match="square_avg"):
        rmsprop.load_state_dict(adam.state_dict())


def test_linear_schedule_falls_to_zero_at_the_horizon_and_stays_there():
    decay = LinearDecay(1000)
    assert decay(0) == 1.0 and decay(250) == 0.75 and decay(1000) == 0.0 and decay(5000) == 0.0
    assert lr_schedule("constant", None) is None
    with pytest.raises(ValueError, match="lr_horizon"):
        lr_schedule("linear", None)


def test_gradient_step_clips_schedules_and_reports():
    net = make_net(0)
    step = GradientStep(Adam(net.parameters(), lr=1e-2), max_grad_norm=0.1, schedule=LinearDecay(100))

    class CountingSync:
        calls = 0

        def gradients(self, params):
            CountingSync.calls += 1

    loss = net(torch.randn(16, 5)).pow(2).sum() * 100  # a gradient far over the clip
    stats = step(loss, CountingSync(), env_steps=75)
    assert stats["lr"] == pytest.approx(2.5e-3)
    assert float(stats["grad_norm"]) > 0.1  # reported before clipping
    clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in net.parameters()))
    assert float(clipped) == pytest.approx(0.1, rel=1e-4)
    assert CountingSync.calls == 1


def test_kl_schedule_raises_the_rate_while_the_policy_barely_moves_and_lowers_it_when_it_moves_too_far():
    schedule = KLAdaptive(target=0.01)
    assert schedule.next_lr(1e-3, kl=0.001) == pytest.approx(1.5e-3)  # under half the target
    assert schedule.next_lr(1e-3, kl=0.03) == pytest.approx(1e-3 / 1.5)  # over twice the target
    assert schedule.next_lr(1e-3, kl=0.01) == 1e-3
    assert schedule.next_lr(9e-3, kl=0.0) == 1e-2 and schedule.next_lr(1.2e-6, kl=1.0) == 1e-6  # bounded


def test_kl_schedule_moves_the_learners_rate_step_by_step_and_a_checkpoint_keeps_it():
    cfg = load_config("cartpole-ppo", ["algo.lr_schedule=kl", "algo.kl_target=0.5", "algo.lr=0.001"])
    actor = build_actor(cfg, 0)
    learner = build_learner(cfg)
    while not learner.ready():
        learner.consume(actor.collect())
    stats = learner.update()
    steps = cfg.algo.epochs * cfg.algo.minibatches
    assert learner.algo.optimizer.lr == pytest.approx(min(0.001 * 1.5**steps, 1e-2))  # KL far below 0.25
    assert stats["lr"] < learner.algo.optimizer.lr  # the logged rate: the mean of those the steps used
    resumed = build_learner(cfg, learner.state_dict())
    assert resumed.algo.optimizer.lr == learner.algo.optimizer.lr


def test_kl_schedule_is_refused_where_there_is_no_policy_kl_or_a_learner_group_would_drift_apart():
    with pytest.raises(ConfigError, match="algo.lr_schedule 'kl' steers by the policy's KL, which dqn does not have"):
        load_config("cartpole-dqn", ["algo.lr_schedule=kl"])
    with pytest.raises(ConfigError, match="group of 2 learners apart"):
        load_config("cartpole-ppo", ["algo.lr_schedule=kl", "topology.learners=2", "topology.actors=2"])
