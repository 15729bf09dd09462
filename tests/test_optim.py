"""Our foreach Adam against torch.optim.Adam."""

from __future__ import annotations

import subprocess
import sys

import torch

from tianji.optim import Adam


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def test_matches_torch_adam_step_for_step():
    ours_net, ref_net = make_net(0), make_net(0)
    ours = Adam(ours_net.parameters(), lr=3e-3, eps=1e-5)
    ref = torch.optim.Adam(ref_net.parameters(), lr=3e-3, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        x = torch.randn(32, 5, generator=gen)
        for net, opt in ((ours_net, ours), (ref_net, ref)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
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
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(a, b)


def test_does_not_import_dynamo():
    code = ("import sys, torch; from tianji.optim import Adam; n = torch.nn.Linear(2, 2); o = Adam(n.parameters(), 0.1);"
            "n(torch.ones(1, 2)).sum().backward(); o.step(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
