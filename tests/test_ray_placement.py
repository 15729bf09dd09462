"""How the Ray launcher fits a run's roles to a cluster (pure functions, no Ray): CPU shares when the
cluster has fewer CPUs than role threads, and placements that can never succeed refused at once."""

from __future__ import annotations

from tianji.config import load_config
from tianji.runtime.launchers.ray import bundles, cpu_share, unplaceable


def test_roles_share_the_cpus_of_a_small_cluster():
    cfg = load_config("cartpole-ppo", ["eval.interval_s=10"])  # a learner, two actors and the evaluator
    assert cpu_share(cfg, cluster_cpus=8) == 1.0
    share = cpu_share(cfg, cluster_cpus=2)
    assert share == 0.5
    wanted = bundles(cfg, share)
    assert sum(b["CPU"] for b in wanted.values()) == 2.0
    assert unplaceable(wanted, [{"CPU": 2.0}]) == []
    assert cpu_share(load_config("cartpole-ppo", ["ray.role_cpus=1"]), cluster_cpus=2) == 1.0  # set by hand


def test_a_placement_that_can_never_succeed_says_what_is_missing():
    cfg = load_config("cartpole-ppo", ["ray.learner_gpus=1", "ray.actor_resources={worker_node: 1}"])
    problems = unplaceable(bundles(cfg), [{"CPU": 4.0, "worker_node": 1.0}])
    assert any("learner0 asks" in p and "GPU 0" in p for p in problems), problems
    assert any("2 worker_node in all, the cluster has 1" in p for p in problems), problems
    assert unplaceable(bundles(cfg), [{"CPU": 4.0, "GPU": 1.0, "worker_node": 2.0}]) == []
