"""Cooperative multi-agent training: QMIX's pure pieces against references, masking, the SMAX and
PettingZoo adapters, the actor's dict rows, and short runs of QMIX and MAPPO on every launcher.

JAX is never imported into this process (it forks role processes): SMAX checks and runs happen in
fresh interpreters (tests/smax_checks.py, the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tianji.algos.common.returns import td_lambda_targets
from tianji.algos.qmix import (
    Mixer,
    QMIXConfig,
    QMIXPolicy,
    _random_available,
    double_q_next,
    masked_argmax,
)
from tianji.config import ConfigError, EnvConfig, load_config
from tianji.envs.make import env_spaces, make_vector_env
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.tools.train import train

from conftest import assert_lag_bounded, load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SPREAD = "pettingzoo:mpe2.simple_spread_v3"


# ---------------------------------------------------------------- QMIX math


def test_mixer_is_monotonic_in_every_agents_q():
    torch.manual_seed(0)
    mixer = Mixer(n_agents=4, state_dim=7, embed=8)
    q = torch.randn(256, 4, requires_grad=True)
    state = torch.randn(256, 7) * 3
    mixer(q, state).sum().backward()
    assert (q.grad >= 0).all()
    assert q.grad.abs().sum() > 0


def lambda_return_reference(r, q_next, done, term, gamma, lam):
    """Forward view: G_t = (1 - lam) sum_n lam^(n-1) G_t^(n) + lam^(N-1) G_t^(N), N the steps to the end
    of the sequence or of the episode (whose last n-step return bootstraps from Q of the state after a
    truncated step, from nothing after a terminated one)."""
    T = len(r)
    out = np.zeros(T)
    for t in range(T):
        end = next((u for u in range(t, T) if done[u]), T - 1)  # last step that belongs to the return
        horizon = end - t + 1

        def n_step(n, t=t):
            u = t + n - 1
            value = sum(gamma**i * r[t + i] for i in range(n))
            return value + (0.0 if term[u] else gamma**n * q_next[u])

        out[t] = sum((1 - lam) * lam ** (n - 1) * n_step(n) for n in range(1, horizon)) + lam ** (horizon - 1) * n_step(
            horizon
        )
    return out


@pytest.mark.parametrize("case", ["no end", "terminated", "truncated", "both"])
def test_td_lambda_targets_match_the_forward_view(case):
    rng = np.random.default_rng(3)
    T, gamma, lam = 7, 0.9, 0.6
    r = rng.normal(size=T)
    q_next = rng.normal(size=T)  # Q_tot of the state reached at each step
    done = np.zeros(T, bool)
    term = np.zeros(T, bool)
    if case in ("terminated", "both"):
        done[2] = term[2] = True
    if case in ("truncated", "both"):
        done[5] = True
    got = td_lambda_targets(
        torch.tensor(r)[:, None],
        torch.tensor(q_next)[:, None],
        torch.tensor(q_next[-1:]),
        torch.tensor(done)[:, None],
        torch.tensor(term)[:, None],
        gamma,
        lam,
    )[:, 0].numpy()
    np.testing.assert_allclose(got, lambda_return_reference(r, q_next, done, term, gamma, lam), rtol=1e-6, atol=1e-9)
    one_step = td_lambda_targets(
        torch.tensor(r)[:, None],
        torch.tensor(q_next)[:, None],
        torch.tensor(q_next[-1:]),
        torch.tensor(done)[:, None],
        torch.tensor(term)[:, None],
        gamma,
        0.0,
    )[:, 0].numpy()
    np.testing.assert_allclose(one_step, r + gamma * q_next * ~term, rtol=1e-6)


def test_unavailable_actions_are_never_chosen_nor_used_in_targets():
    q = torch.tensor([[5.0, 1.0, 2.0], [0.0, 9.0, -1.0]])
    avail = torch.tensor([[False, True, True], [True, False, True]])
    assert masked_argmax(q, avail).tolist() == [2, 0]
    q_target = torch.tensor([[100.0, 1.5, 2.5], [0.5, 100.0, -1.5]])  # the unavailable ones would dominate
    assert double_q_next(q, q_target, avail).tolist() == [2.5, 0.5]
    rng = np.random.default_rng(0)
    masks = rng.random((2000, 3, 6)) < 0.4
    masks[..., 5] = True  # at least one action available
    picks = _random_available(masks, rng)
    assert masks[np.arange(2000)[:, None], np.arange(3)[None], picks].all()
    assert len(np.unique(picks)) == 6  # every available action gets picked


def test_qmix_policy_explores_and_exploits_only_available_actions():
    obs_space, act_space = env_spaces(EnvConfig(id=SPREAD))
    rng = np.random.default_rng(1)
    for epsilon in (1.0, 0.0):
        policy = QMIXPolicy(QMIXConfig(epsilon_start=epsilon, epsilon=epsilon), obs_space, act_space, None)
        for step in range(50):
            avail = rng.random((8, 3, 5)) < 0.5
            avail[..., 0] = True
            obs = {
                "obs": rng.normal(size=(8, 3, 18)).astype(np.float32),
                "state": np.zeros((8, 54), np.float32),
                "avail_actions": avail,
                "active": np.ones((8, 3), bool),
                "first": np.full((8, 1), step == 0),
            }
            action, record = policy.act(obs)
            assert avail[np.arange(8)[:, None], np.arange(3)[None], action].all()
            assert (record["last_action"] == -1).all() == (step == 0)


# ---------------------------------------------------------------- adapters


@pytest.mark.parametrize(
    "checks", [["shapes", "win", "truncation"], pytest.param(["maps"], marks=pytest.mark.slow)], ids=["adapter", "maps"]
)
def test_smax_adapter(checks):
    """The checks in one fresh interpreter: JAX and the SMAX maps compile once for all of them."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "smax_checks.py"), *checks],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "jax" not in sys.modules


def test_smax_spaces_are_read_without_jax_in_this_process():
    obs_space, act_space = env_spaces(EnvConfig(id="smax:3m"))
    assert obs_space["obs"].shape == (3, 75) and obs_space["avail_actions"].shape == (3, 8)
    assert list(act_space.nvec) == [8, 8, 8]
    assert "jax" not in sys.modules
    with pytest.raises(ConfigError, match="SMAX has no map 'nomap'"):
        env_spaces(EnvConfig(id="smax:nomap"))


def test_smax_without_its_extra_says_what_to_install(tmp_path, monkeypatch):
    fake = tmp_path / "jaxmarl"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named jaxmarl')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the child that reads the map's sizes sees it first
    with pytest.raises(ConfigError, match=r"pip install 'tianji\[smax\]'"):
        env_spaces(EnvConfig(id="smax:8m"))


def test_pettingzoo_simple_spread_adapter():
    envs = make_vector_env(EnvConfig(id=SPREAD, kwargs={"N": 3, "max_cycles": 5}), 2)
    obs, _ = envs.reset(seed=0)
    assert obs["obs"].shape == (2, 3, 18) and obs["state"].shape == (2, 54) and obs["first"].all()
    assert obs["avail_actions"].shape == (2, 3, 5) and obs["avail_actions"].all() and obs["active"].all()
    assert envs.recorded_info == ()  # no wins in simple_spread
    for _ in range(5):
        obs, reward, terminated, truncated, info = envs.step(np.zeros((2, 3), np.int64))
        assert reward.shape == (2,) and reward.dtype == np.float32
    assert truncated.all() and not terminated.any(), "max_cycles is a time-out"
    obs, reward, *_ = envs.step(np.zeros((2, 3), np.int64))
    assert obs["first"].all() and (reward == 0).all()


def test_pettingzoo_errors_name_the_field():
    with pytest.raises(ConfigError, match="cannot import PettingZoo module 'nosuch.module'"):
        make_vector_env(EnvConfig(id="pettingzoo:nosuch.module"), 1)
    with pytest.raises(ConfigError, match="env.kwargs"):
        make_vector_env(EnvConfig(id=SPREAD, kwargs={"no_such_option": 1}), 1)


def test_actor_records_dict_observations_and_carries_qmix_memory_across_fragments():
    cfg = load_config("smax-3m-qmix", [f"env.id={SPREAD}", "topology.envs_per_actor=4", "topology.fragment_length=10"])
    actor = build_actor(cfg, 0)
    first = actor.collect().arrays
    assert first["obs"].shape == (10, 4, 3, 18) and first["avail_actions"].shape == (10, 4, 3, 5)
    assert first["state"].shape == (10, 4, 54) and first["action"].shape == (10, 4, 3)
    assert first["h0"].shape == (4, 3, 64) and not first["h0"].any()  # the episode starts with no memory
    second = actor.collect().arrays
    assert second["h0"].any(), "the next fragment starts from the memory where the last one ended"
    np.testing.assert_array_equal(second["last_action"][0], first["action"][-1])
    learner = build_learner(cfg)
    for arrays in (first, second) * 40:
        learner.algo.add(arrays)
    stats = learner.algo.update()
    assert np.isfinite(stats["loss"])


# ---------------------------------------------------------------- end to end


def run_cli(*args: str, timeout: int = 240) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tianji", "train", *args, "--set", "logging.console=false"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    run_dir = next(line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("run directory"))
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.mark.parametrize("preset,launcher", [("smax-3m-qmix", "inline"), ("smax-3m-mappo", "local")])
def test_smax_runs_end_to_end(tmp_path, preset, launcher):
    summary = run_cli(
        preset,
        "--launcher",
        launcher,
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "stop.max_env_steps=6000",
        "--set",
        "stop.max_wall_time_s=120",
        "--set",
        "topology.envs_per_actor=16",
        "--set",
        "eval.interval_s=1",
        "--set",
        "eval.episodes=8",
        "--set",
        "algo.learning_starts_sequences=16" if preset.endswith("qmix") else "algo.epochs=1",
    )
    assert summary["env_steps"] >= 6000 and summary["updates"] > 0
    assert summary["final_win_rate100"] is not None and summary["final_eval_win_rate"] is not None
    assert_lag_bounded(summary, load_config(preset, []).balance.max_policy_lag, 0.05 if "qmix" in preset else 0.0)


@pytest.mark.parametrize("algo,launcher", [("qmix", "local"), ("mappo", "inline"), ("mappo-recurrent", "local")])
def test_pettingzoo_runs_end_to_end(tmp_path, algo, launcher):
    preset = "smax-3m-qmix" if algo == "qmix" else "mpe-spread-mappo"
    extra = {
        "qmix": ["algo.learning_starts_sequences=8"],
        "mappo": ["algo.epochs=1"],
        "mappo-recurrent": ["algo.epochs=1", "algo.recurrent=true"],
    }[algo]
    cfg = load_config(
        preset,
        [
            f"env.id={SPREAD}",
            "env.kwargs={N: 3, max_cycles: 25}",
            "stop.target_return=null",
            "stop.max_env_steps=4000",
            "topology.envs_per_actor=8",
            "eval.interval_s=null",
            "logging.console=false",
            *extra,
        ],
    )
    _, summary = train(cfg, launcher=launcher, run_dir=str(tmp_path / "run"))
    assert summary["env_steps"] >= 4000 and summary["updates"] > 0 and summary["episodes"] > 0
    assert summary["final_win_rate100"] is None  # PettingZoo envs report no wins


def test_eval_win_rate_target_needs_evaluation():
    with pytest.raises(ConfigError, match="eval_win_rate"):
        load_config("smax-3m-qmix", ["eval.interval_s=null"])


# An untrained greedy policy wins no 3m game; the bars leave room for the slowest seed measured
# (benchmarks/results/test-bars.md).
UNTRAINED_WIN_RATE_3M = 0.0
MAPPO_BAR, MAPPO_SECONDS = 0.6, 300
QMIX_BAR, QMIX_SECONDS = 0.75, 300


@pytest.mark.slow
def test_mappo_wins_smax_3m(tmp_path):
    """MAPPO learns the StarCraft map 3m: greedy win rate MAPPO_BAR within MAPPO_SECONDS."""
    summary = run_cli(
        "smax-3m-mappo",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"stop.target_return={MAPPO_BAR}",
        "--set",
        f"stop.max_wall_time_s={MAPPO_SECONDS}",
        timeout=MAPPO_SECONDS + 60,
    )
    assert summary["target_reached"], summary
    assert summary["return_at_target"] >= MAPPO_BAR > UNTRAINED_WIN_RATE_3M


@pytest.mark.slow
def test_qmix_wins_smax_3m(tmp_path):
    """QMIX learns 3m too (its other tests only check that updates happen): greedy win rate QMIX_BAR
    within QMIX_SECONDS."""
    summary = run_cli(
        "smax-3m-qmix",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"stop.target_return={QMIX_BAR}",
        "--set",
        f"stop.max_wall_time_s={QMIX_SECONDS}",
        timeout=QMIX_SECONDS + 60,
    )
    assert summary["target_reached"], summary
    assert summary["return_at_target"] >= QMIX_BAR > UNTRAINED_WIN_RATE_3M


@pytest.mark.parametrize("overrides", [["algo.recurrent=true"], ["algo.centralised_value=false"]])
def test_mappo_recurrent_and_ippo_variants_collect_and_train(overrides):
    cfg = load_config("mpe-spread-mappo", ["topology.envs_per_actor=4", "topology.fragment_length=10", *overrides])
    actor, learner = build_actor(cfg, 0), build_learner(cfg)
    first = actor.collect().arrays
    second = actor.collect().arrays
    if cfg.algo.recurrent:
        assert not first["h0"].any() and second["h0"].any(), "memory carried into the next fragment"
    else:
        assert "h0" not in first and first["value"].shape == (10, 4, 3)  # IPPO: a value per agent
    for arrays in (first, second):
        learner.algo.add(arrays)
        stats = learner.algo.update()
        assert np.isfinite(stats["policy_loss"]) and np.isfinite(stats["value_loss"])


def test_the_smax_maps_table_reads_win_rates_at_each_mark(monkeypatch, tmp_path):
    smax = load_benchmark(monkeypatch, "smax")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"name": "smax-3s5z-qmix", "seed": 1, "env": {"id": "smax:3s5z"}, "stop": {"target_return": 0.9}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "summary.json").write_text(json.dumps({"target_reached": True, "time_to_target_s": 1500.0}))
    rows = [(300.0, float("nan")), (590.0, 0.25), (1200.0, 0.5), (1500.0, 0.91)]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"time_s": t, "env_steps": int(t * 1000), "eval/win_rate": w}) + "\n" for t, w in rows)
    )
    row = smax.map_run_row(run_dir)
    assert row["win_rate"] == {"10": 0.25, "30": 0.91, "60": 0.91} and row["map"] == "3s5z"
    table = smax.maps_markdown([row])
    assert "| `smax-3s5z-qmix` | 1 | 0.25 / 0.91 / 0.91 | 25 min (target 0.9) |" in table
    assert "| 1.00 | 0.9: 1/1 seeds |" in table
