"""benchmarks/zoo.py's per-seed health: the lowest entropy and the largest one-update KL a run logged."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_a_seeds_line_names_its_lowest_entropy_and_largest_update_kl(monkeypatch, tmp_path):
    zoo = load_benchmark(monkeypatch, "zoo")
    rows = [
        {"env_steps": 0},  # before the first update: neither metric
        {"env_steps": 10, "train/entropy": 0.6, "train/approx_kl": 0.01},
        {"env_steps": 20, "train/entropy": 0.02, "train/approx_kl": 0.7},
        {"env_steps": 30, "train/entropy": 0.3, "train/approx_kl": 0.02},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert zoo.stability(tmp_path) == " (lowest entropy 0.020, largest update KL 0.700)"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"env_steps": 5, "train/td_error": 1.0}) + "\n")
    assert zoo.stability(tmp_path) == ""  # DQN logs neither
