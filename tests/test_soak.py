"""benchmarks/soak.py judges growth from medians at each end: a role's memory that swings with the allocator
passes, one that climbs steadily fails (`--judge` re-reads saved samples, no run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def samples(learner_rss) -> list[dict]:
    return [
        {
            "minute": float(minute),
            "rss_mb": {"driver": 248.0, "learner0": rss},
            "fds": {"driver": 31, "learner0": 47},
            "shm_files": 2,
            "shm_mb": 27.9,
        }
        for minute, rss in enumerate(learner_rss)
    ]


def judge(tmp_path: Path, learner_rss: list[float]) -> str:
    saved = tmp_path / "soak.json"
    last_row = {"env_steps": 1000, "balance/policy_version": 10}
    saved.write_text(
        json.dumps(
            {
                "preset": "pong-appo",
                "minutes": 60,
                "overrides": [],
                "samples": samples(learner_rss),
                "last_row": last_row,
            }
        )
    )
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--judge", str(saved), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.md").exists() and json.loads((tmp_path / "out.json").read_text())["last_row"] == last_row
    return done.stdout


@pytest.mark.parametrize(
    "learner_rss, verdict",
    [
        ([376.0] * 5 + [309.0, 381.0, 323.0, 330.0, 316.0] * 10 + [368.0], "met"),  # swings; first 309, last 368
        ([300.0 * 1.01**minute for minute in range(60)], "NOT met"),  # +1 % a minute
    ],
)
def test_soak_growth_is_judged_on_medians_so_a_swing_passes_and_a_climb_fails(tmp_path, learner_rss, verdict):
    assert f"no fd or shm growth): {verdict}" in judge(tmp_path, learner_rss)
