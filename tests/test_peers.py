"""benchmarks/peers.py at its smallest: one seed of CartPole PPO for TianJi, RLlib and SB3 with a short cap,
and the table it writes. Needs the `peers` extra (pip install -e '.[peers]'); skipped without it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MISSING = [
    m
    for m in ("ray.rllib", "stable_baselines3", "rl_zoo3")
    if importlib.util.find_spec(m.split(".")[0]) is None
    or (m == "ray.rllib" and importlib.util.find_spec("tree") is None)
]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(MISSING), reason=f"the peers extra is not installed (no {', '.join(MISSING)}): pip install -e '.[peers]'"
)
def test_peers_benchmark_at_its_smallest_writes_its_table(tmp_path):
    out = tmp_path / "peers"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "peers.py"),
        "--tasks",
        "cartpole-ppo",
        "--seeds",
        "1",
        "--cap-s",
        "25",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| cartpole-ppo")]
    assert [row.split("|")[2].strip() for row in rows] == ["tianji", "rllib", "sb3"], table
    assert all("1 reached" in row or "0/1 reached" in row or "1/1 reached" in row for row in rows), table
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["versions"]["ray"]
    assert "4.37x" in table  # the paper's claim stands next to the measurement

    # a second sitting on the same --work reads the finished runs instead of running them again
    logs = {log: log.stat().st_mtime_ns for log in (tmp_path / "work").glob("*.log")}
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert {log: log.stat().st_mtime_ns for log in (tmp_path / "work").glob("*.log")} == logs
    assert out.with_suffix(".md").read_text().splitlines()[3:] == table.splitlines()[3:]
