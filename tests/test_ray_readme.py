"""The docs' cluster block (docs/launchers.md, "A Ray cluster"), run as written (the head's address filled in): a fresh
token, a head and a second `ray start` node on this machine, a run that joins them and one with a
Ray instance of its own. Marked `ray`; it stops every Ray process on this machine when done."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

LAUNCHERS_PAGE = Path(__file__).parents[1] / "docs" / "launchers.md"
COUNT_NODES = "import ray; ray.init(address='auto', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"


def cluster_block() -> list[str]:
    section = LAUNCHERS_PAGE.read_text().split("## A Ray cluster", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def fresh_environment(home: Path) -> dict[str, str]:
    """As a new shell has it: no loopback switch left by earlier tests in this process, no address of their
    clusters; `ray` and `tianji` of this environment first on the PATH."""
    fresh = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**fresh, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def machine_address(env: dict[str, str]) -> str:
    """The address `ray start --head` picks for this machine, asked in a fresh process."""
    probe = "import ray; print(ray.util.get_node_ip_address())"
    return subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


def test_the_readme_cluster_block_runs_as_written(tmp_path):
    env = fresh_environment(tmp_path / "home")
    (tmp_path / "home").mkdir()
    address = machine_address(env)
    if address.startswith("127."):
        pytest.skip("this machine has no network address; the docs' two `ray start` nodes need one")
    lines = cluster_block()
    assert any(line.startswith("ray start --head") for line in lines)
    script = "set -euo pipefail\n" + "\n".join(lines).replace("HEAD_IP", address)
    try:
        done = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        nodes = subprocess.run(
            [sys.executable, "-c", COUNT_NODES], env=env, capture_output=True, text=True, timeout=120
        ).stdout.strip()
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert nodes == "2", f"the cluster had {nodes!r} nodes"
    runs = sorted((tmp_path / "runs").glob("cartpole-ppo-*"))
    assert len(runs) == 2, output[-2000:]
    for run in runs:
        summary = (run / "summary.json").read_text()
        assert '"target_reached": true' in summary, summary
