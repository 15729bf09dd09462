"""benchmarks/pong_staleness.py's mean-curve verdict: averaged curves, bootstrap intervals, the 10 % bar."""

from __future__ import annotations

import json

import numpy as np

from conftest import load_benchmark


def run_row(bound: int, variant: str, seed: int, scores: list[float]) -> dict:
    keys = [f"{0.1 * i:.1f}M" for i in range(2, 10)]
    return {
        "run": f"lag{bound}-{variant}-s{seed}",
        "bound": bound,
        "variant": variant,
        "seed": seed,
        "score_at": dict(zip(keys, scores, strict=True)),
    }


def test_crossing_interpolates_and_says_never(monkeypatch):
    script = load_benchmark(monkeypatch, "pong_staleness")
    grid = np.array([0.2e6, 0.3e6, 0.4e6])
    assert script.crossing(grid, np.array([-20.0, -16.0, -12.0]), -15.0) == 0.325e6
    assert script.crossing(grid, np.array([-20.0, -19.0, -18.0]), -15.0) == float("inf")


def test_mean_curves_decide_only_when_the_interval_is_clear(monkeypatch):
    script = load_benchmark(monkeypatch, "pong_staleness")
    sync_curve = np.linspace(-20, 0, 8)  # -15 after 0.375M, -10 after 0.55M
    sync = [run_row(0, "on", s, list(sync_curve + d)) for s, d in enumerate((-0.3, 0.0, 0.3))]
    late = [run_row(4, "on", s, list(np.linspace(-20, -6, 8) + d)) for s, d in enumerate((-0.2, 0.0, 0.2))]
    same = [run_row(2, "on", s, list(sync_curve + d)) for s, d in enumerate((-0.1, 0.0, 0.1))]
    noisy = [run_row(8, "on", s, list(sync_curve + d)) for s, d in enumerate((-6.0, 0.0, 4.0))]
    lines = script.mean_curves(sync + late + same + noisy, 900_000)
    blank = lines.index("")
    pooled, matched = lines[1:blank], lines[blank + 2 :]
    verdicts = {line.split(",")[0]: line.rsplit(": ", 1)[1] for line in pooled}
    assert verdicts == {"- bound 4": "NOT within 10 %", "- bound 2": "within 10 %", "- bound 8": "undecided"}
    assert "0.38M / 0.55M" in lines[0]
    # seed by seed the noisy setting's seeds 0 and 2 stray as far as the synchronous ones: still undecided
    assert [line.rsplit(": ", 1)[1] for line in matched] == [
        "within 10 %",
        "NOT within 10 %",
        "undecided",
    ]  # bounds 2, 4, 8


def test_two_runs_get_no_verdict(monkeypatch):
    script = load_benchmark(monkeypatch, "pong_staleness")
    curve = list(np.linspace(-20, 0, 8))
    rows = [run_row(0, "on", s, curve) for s in range(3)] + [run_row(4, "on", s, curve) for s in range(2)]
    assert not any(line.startswith("- bound 4") for line in script.mean_curves(rows, 900_000))


def test_results_from_before_variants_join_with_their_correction_as_the_variant(monkeypatch, tmp_path):
    script = load_benchmark(monkeypatch, "pong_staleness")
    old = {"runs": [{"run": "lag0-on-s0", "bound": 0, "correction": "on", "seed": 0}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    rows, _ = script.earlier_results([tmp_path / "old.json"], taken=set())
    assert rows[0]["variant"] == "on" and script.is_sync(rows[0])
