"""The documentation tells the truth: every command of Getting started runs as written, and every metric a
run writes is explained in Outputs and metrics."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tianji.config import build_config
from tianji.tools.train import train

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)


@pytest.mark.slow
def test_every_command_block_of_getting_started_runs():
    """As a newcomer runs them: from the repository's root, in this environment (the install block finds
    everything installed and reinstalls this checkout in place). The run directory they make is removed."""
    first = REPO / "runs" / "first"
    shutil.rmtree(first, ignore_errors=True)
    blocks = bash_blocks(DOCS / "getting-started.md")
    assert len(blocks) >= 5
    try:
        for block in blocks:
            result = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", block], cwd=REPO, capture_output=True, text=True, timeout=600
            )
            assert result.returncode == 0, f"{block}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        assert (first / "summary.json").exists()
    finally:
        shutil.rmtree(first, ignore_errors=True)


def documented_metrics() -> set[str]:
    page = (DOCS / "outputs.md").read_text()
    section = page.split("## Metrics", 1)[1].split("## The summary", 1)[0]
    return set(re.findall(r"`([a-z_0-9]+(?:/[a-zA-Z_0-9]+)*)`", section))


def tiny(algo: dict, **more) -> dict:
    return {
        "name": "docs",
        "env": {"id": "CartPole-v1"},
        "algo": algo,
        "topology": {"actors": 1, "envs_per_actor": 4, "fragment_length": 16},
        "stop": {"max_env_steps": 3072},
        "logging": {"console": False, "interval_s": 0.05},
        "eval": {"interval_s": 0.2, "episodes": 2},
        **more,
    }


@pytest.mark.parametrize(
    "raw",
    [
        tiny({"name": "ppo", "epochs": 1, "minibatches": 1}),
        tiny(
            {"name": "dqn", "learning_starts": 256, "batch_size": 32}, balance={"max_policy_lag": 32, "replay_ratio": 2}
        ),
        tiny({"name": "impala"}),
    ],
    ids=["ppo", "dqn", "impala"],
)
def test_every_metric_a_run_writes_is_explained_in_the_docs(raw, tmp_path):
    run_dir, _ = train(build_config({**raw, "logging": {**raw["logging"], "run_root": str(tmp_path)}}), "inline")
    with open(run_dir / "metrics.csv", newline="") as f:
        columns = next(csv.reader(f))
    documented = documented_metrics()
    missing = [c for c in columns if re.sub(r"learner\d+", "learnerN", c) not in documented]
    assert not missing, f"metrics not in docs/outputs.md: {missing}"
