"""Learning tests with reward thresholds (slow: run in CI, skip locally with -m 'not slow')."""

from __future__ import annotations

import pytest

from tianji.config import load_config
from tianji.runtime.run import train


@pytest.mark.slow
def test_cartpole_ppo_reaches_475(tmp_path):
    cfg = load_config("cartpole-ppo", [f"logging.run_root={tmp_path}", "logging.console=false",
                                       "stop.max_wall_time_s=150"])
    _, summary = train(cfg, "local")
    assert summary["target_reached"], summary
    assert summary["final_return_mean100"] >= 475
    assert summary["policy_lag_max"] <= cfg.balance.max_policy_lag


@pytest.mark.slow
def test_cartpole_dqn_greedy_evaluation_reaches_475(tmp_path):
    cfg = load_config("cartpole-dqn", [f"logging.run_root={tmp_path}", "logging.console=false",
                                       "stop.max_wall_time_s=240"])
    _, summary = train(cfg, "local")
    assert summary["target_reached"], summary
    assert summary["final_eval_return_mean"] >= 475
