"""A lost machine survived: on a test cluster made on this machine, the node that runs the actors or
the learner is removed mid-run (as a preempted cloud node disappears). Ray reschedules the lost
roles' bundles on a node that can hold them; the driver restarts the roles there (the learner from
the checkpoint the driver keeps) and the run reaches its target. Marked `ray`."""

from __future__ import annotations

import csv
import json
import threading
import time

import pytest

from tianji.config import load_config
from tianji.tools.train import train

from conftest import has_set, newest_set, wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


def make_cluster(spare: str):
    """A head for the driver (and the roles not pinned elsewhere), and two nodes able to run `spare`
    roles: the run starts on one of them and moves to the other when it is removed."""
    from ray.cluster_utils import Cluster

    from tianji.runtime.launchers.ray_boot import loopback_only

    loopback_only(ray)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"head_node": 2},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={spare: 2}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture
def cluster_for(request):
    made = []

    def make(spare: str):
        made.append(make_cluster(spare))
        return made[0]

    yield make
    if ray.is_initialized():
        ray.shutdown()
    for cluster in made:
        cluster.shutdown()


def remove_node_of(cluster, run_dir, role: str, removed: dict) -> None:
    """Once the run has trained a while, remove the node `role` runs on."""
    placement = run_dir / "placement.json"
    if not wait_for(lambda: placement.exists() and has_set(run_dir), 120):
        return
    time.sleep(0.2)
    node_id = json.loads(placement.read_text())[role]["node"]
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    removed["node"] = node_id
    removed["version"] = json.loads((newest_set(run_dir) / "manifest.json").read_text())["policy_version"]
    cluster.remove_node(node, allow_graceful=False)


def run_losing(cluster, tmp_path, role: str, *overrides: str) -> tuple[dict, dict, dict]:
    run_dir = tmp_path / "run"
    cfg = load_config(
        "cartpole-ppo",
        [
            f"logging.run_root={tmp_path}",
            "logging.console=false",
            "stop.max_wall_time_s=240",
            "checkpoint.interval_s=1",
            f"ray.address={cluster.address}",
            *overrides,
        ],
    )
    removed: dict = {}
    remover = threading.Thread(target=remove_node_of, args=(cluster, run_dir, role, removed))
    remover.start()
    _, summary = train(cfg, "ray", run_dir=str(run_dir))
    remover.join()
    assert "node" in removed, "the run ended before the node could be removed"
    return summary, removed, json.loads((run_dir / "placement.json").read_text())


def test_losing_the_actors_node_restarts_them_on_another_and_the_run_reaches_its_target(cluster_for, tmp_path):
    summary, removed, places = run_losing(
        cluster_for("actor_node"),
        tmp_path,
        "actor0",
        "ray.actor_resources={actor_node: 1}",
        "ray.learner_resources={head_node: 1}",
    )
    assert summary["target_reached"], summary
    assert summary["role_restarts"] >= 1 and summary["learner_restarts"] == 0
    assert places["actor0"]["node"] != removed["node"]


def test_losing_the_learners_node_restarts_it_from_the_checkpoint_and_the_run_reaches_its_target(cluster_for, tmp_path):
    summary, removed, places = run_losing(
        cluster_for("learner_node"),
        tmp_path,
        "learner0",
        "ray.learner_resources={learner_node: 1}",
        "ray.actor_resources={head_node: 1}",
    )
    assert summary["target_reached"], summary
    assert summary["learner_restarts"] >= 1
    assert places["learner0"]["node"] != removed["node"]
    # nothing trained before the last checkpoint is lost: once the version passed the checkpoint's, it never
    # dips below it (a learner restarted from scratch would count from 0 again)
    rows = csv.DictReader((tmp_path / "run" / "metrics.csv").read_text().splitlines())
    versions = [int(float(row["balance/policy_version"])) for row in rows]
    first_past = next(i for i, v in enumerate(versions) if v >= removed["version"])
    assert min(versions[first_past:]) >= removed["version"], (removed["version"], versions[first_past:])
