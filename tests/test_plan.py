"""Layout planning from synthetic rates, the layout space, the calibration cache, and `actors: auto`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tianji import cli
from tianji.config import load_config
from tianji.runtime.balance import LagController
from tianji.tools import calibration, plan
from tianji.tools.calibration import Calibration, Space
from tianji.tools.plan import choose, layout_space, oversubscription_warning, predict


def config(bound=8, **topology):
    return load_config(
        "cartpole-ppo", [f"topology.{k}={v}" for k, v in topology.items()] + [f"balance.max_policy_lag={bound}"]
    )


def synthetic(actor_rates, learner_rate, fragment_steps=1024, steps_per_update=1024):
    return Calibration(actor_rates, learner_rate, steps_per_update, fragment_steps, seconds=0.0)


def test_throughput_model_bounds_by_actors_learner_and_cpu():
    cal = synthetic({8: 10_000.0}, learner_rate=30_000.0)
    space = Space(envs=[8], actors=[1, 2, 4, 8], fragment_steps=1024, preferred_envs=8)
    rows = {row.actors: row for row in predict(cal, config(bound=100), space, cores=5)}
    assert rows[1].env_steps_per_s == pytest.approx(10_000)  # actor-bound
    assert rows[1].idle_side == "learner"
    assert rows[2].env_steps_per_s == pytest.approx(20_000)
    cpu_bound = 5 / (1 / 10_000 + 1 / 30_000)  # 37,500
    assert rows[4].env_steps_per_s == pytest.approx(min(40_000, 30_000, cpu_bound))  # learner-bound
    assert rows[8].idle_side == "actors"
    assert rows[8].max_lag > rows[4].max_lag  # more producers, more versions per fragment


def test_cpu_bound_applies_on_a_small_machine():
    cal = synthetic({8: 10_000.0}, learner_rate=10_000.0)
    space = Space(envs=[8], actors=[1, 2, 3], fragment_steps=1024, preferred_envs=8)
    rows = {row.actors: row for row in predict(cal, config(), space, cores=1)}
    assert rows[3].env_steps_per_s == pytest.approx(1 / (1 / 10_000 + 1 / 10_000))  # one core shared


def test_choice_prefers_throughput_first():
    cal = synthetic({8: 10_000.0, 32: 40_000.0}, learner_rate=30_000.0)
    space = Space(envs=[8, 32], actors=[1, 2, 3, 4], fragment_steps=1024, preferred_envs=8)
    chosen = choose(predict(cal, config(bound=4), space, cores=8), space.preferred_envs, cores=8)
    assert chosen.envs_per_actor == 32, "8 envs per actor need 3 actors at full load to feed the learner (no slack)"
    assert chosen.chosen and chosen.fragment_length == 32

    cal = synthetic({8: 10_000.0}, learner_rate=100_000.0)
    space = Space(envs=[8], actors=[1, 2, 3, 4], fragment_steps=1024, preferred_envs=8)
    assert choose(predict(cal, config(), space, cores=8), 8).actors == 4  # learner-rich: as many actors as fit


def test_near_ties_spread_production_over_cores_inside_the_lag_bound():
    # one actor already saturates the learner; 1..4 actors are equally fast
    cal = synthetic({32: 40_000.0}, learner_rate=20_000.0)
    space = Space(envs=[32], actors=[1, 2, 3, 4], fragment_steps=1024, preferred_envs=32)
    rows = predict(cal, config(bound=8), space, cores=2)
    rates = [r.env_steps_per_s for r in rows]  # more processes than cores cost a little, inside the tie
    assert max(rates) == pytest.approx(20_000) and min(rates) >= (1 - plan.TIE) * max(rates)
    assert choose(rows, 32, cores=2).actors == 2, "one actor per core"
    # bound 2: lag-aware credits keep 2 fragments in flight, 2 actors need 3 (one queued at the learner)
    rows = predict(cal, config(bound=2), space, cores=2)
    assert [r.held_back for r in rows] == [False, True, True, True]
    assert choose(rows, 32, cores=2).actors == 1, "the bound would hold 2 actors back"
    assert choose(predict(cal, config(bound=100), space, cores=8), 32, cores=8).actors == 4


def test_a_bound_that_holds_actors_back_lowers_the_prediction_and_warns():
    cal = synthetic({8: 10_000.0}, learner_rate=100_000.0)  # actor-bound: every actor counts
    space = Space(envs=[8], actors=[1, 2, 4], fragment_steps=1024, preferred_envs=8)
    rows = {r.actors: r for r in predict(cal, config(bound=2), space, cores=8)}
    assert rows[4].env_steps_per_s == pytest.approx(20_000)  # two in flight: two producing at a time
    assert rows[4].held_back and rows[4].max_lag <= 2
    warning = plan.lag_warning(cal, config(bound=2), rows[4])
    assert "balance.max_policy_lag=2" in warning and "a bound of 6 keeps them all busy" in warning
    assert plan.lag_warning(cal, config(bound=2), rows[2]) is None


def test_predicted_max_lag_matches_the_credit_queue():
    # measured on CartPole PPO (1 fragment per update, 2 credits): 1 actor lag max 3, 2 actors lag max 5
    assert plan.predicted_max_lag(1, 1.0, 2, actors_wait=True) == 3
    assert plan.predicted_max_lag(2, 1.0, 2, actors_wait=True) == 5
    assert plan.predicted_max_lag(2, 1.0, 2, actors_wait=False) == 3  # actor-bound: nothing queues
    assert plan.predicted_max_lag(1, 4.0, 2, actors_wait=True) == 12


def test_layout_space_respects_cores_and_fixed_values():
    space = layout_space(config(), cores=2, plan_envs=True, plan_actors=True)
    assert max(space.actors) <= 4 and 1 in space.actors
    assert space.fragment_steps == 32 * 64 and 32 in space.envs and all(k <= 2048 for k in space.envs)
    fixed = layout_space(config(actors=3), cores=2, plan_envs=False, plan_actors=False)
    assert fixed.actors == [3] and fixed.envs == [32]


def test_calibration_is_cached_per_machine_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TIANJI_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_calibrate(cfg, space):
        calls.append(space)
        return synthetic(dict.fromkeys(space.envs, 50000.0), 20_000.0, space.fragment_steps, space.fragment_steps)

    monkeypatch.setattr(plan, "_calibrate_in_child", fake_calibrate)
    cfg = config(actors="auto")
    resolved, record = plan.resolve_layout(cfg, cores=2)
    assert not record["cached"] and len(calls) == 1
    assert resolved.topology.actors == 2 and resolved.topology.envs_per_actor == 32  # one actor per core
    _, again = plan.resolve_layout(cfg, cores=2)
    assert again["cached"] and len(calls) == 1
    other = config(actors="auto", fragment_length=32)
    plan.resolve_layout(other, cores=2)
    assert len(calls) == 2, "a different fragment size is calibrated anew"
    assert len(list((tmp_path / "plans").glob("*.json"))) == 2
    json.loads(next((tmp_path / "plans").glob("*.json")).read_text())


def test_actors_auto_runs_the_plan_at_start_up(tmp_path, monkeypatch, tiny_config):
    from tianji.tools.train import train

    monkeypatch.setenv("TIANJI_CACHE_DIR", str(tmp_path / "cache"))
    raw = tiny_config().model_dump(mode="json")
    raw["topology"]["actors"] = "auto"
    cfg = load_config("cartpole-ppo", [])
    cfg = cfg.model_validate(raw)
    run_dir, summary = train(cfg, "inline", run_dir=str(tmp_path / "run"))
    saved = (run_dir / "config.yaml").read_text()
    assert "actors: auto" not in saved and "actors:" in saved
    record = json.loads((run_dir / "plan.json").read_text())
    assert record["chosen"]["actors"] >= 1 and not record["cached"]
    assert summary["env_steps"] >= 2048


def test_near_ties_prefer_headroom_on_the_idle_side():
    # learner-bound everywhere; 16 envs leaves the actor at 90 % (fragile), 32 envs at 45 %
    cal = synthetic({16: 22_000.0, 32: 44_000.0}, learner_rate=20_000.0)
    space = Space(envs=[16, 32], actors=[1], fragment_steps=1024, preferred_envs=16)
    chosen = choose(predict(cal, config(), space, cores=4), space.preferred_envs)
    assert chosen.envs_per_actor == 32


def test_learners_are_planned_when_one_learner_is_the_bottleneck():
    cal = Calibration(
        {32: 100_000.0},
        learner_rate=20_000.0,
        steps_per_update=2048,
        fragment_steps=2048,
        seconds=0.0,
        optimizer_steps_per_update=16,
        parameters=10_000,
    )
    space = Space(envs=[32], actors=[1, 2, 4, 8, 16], fragment_steps=2048, preferred_envs=32, learners=(1, 2, 4, 8))
    many = choose(predict(cal, config(bound=100), space, cores=64), 32, cores=64)
    assert many.learners == 8 and many.actors >= 8, "64 cores: the learners are the bottleneck, so add learners"
    assert all(r.actors >= r.learners for r in predict(cal, config(bound=100), space, cores=64))
    two_cores = Space(envs=[32], actors=[1, 2], fragment_steps=2048, preferred_envs=32, learners=(1,))
    assert choose(predict(cal, config(bound=100), two_cores, cores=2), 32, cores=2).learners == 1
    # allreduce pays a collective per optimizer step: a learner of 8 consumes less than one alone
    assert plan.group_learner_rate(cal, 8, "allreduce") < plan.group_learner_rate(cal, 2, "allreduce") < 20_000
    assert plan.group_learner_rate(cal, 8, "average") == 20_000
    assert "8 learners share the training" in plan.explain(cal, many, cores=64)


def test_layout_space_plans_learners_up_to_half_the_cores():
    assert layout_space(config(), cores=64, plan_envs=False, plan_actors=True, plan_learners=True).learners == (
        1,
        2,
        4,
        8,
        16,
        32,
    )
    assert layout_space(config(), cores=2, plan_envs=False, plan_actors=True, plan_learners=True).learners == (1,)


def test_the_planner_measures_a_learner_group_on_this_machine_and_models_it():
    costs = calibration.measure_local_group(10_000)  # two processes, gloo over loopback, the learners' own probe
    assert costs["allreduce_bucket_bytes"] == 40_000
    # (no order between the two: on a loaded machine one number can take longer than the bucket)
    assert 0 < costs["allreduce_latency_s"] < 1 and 0 < costs["allreduce_bucket_s"] < 1
    assert costs["allreduce_bytes_per_s"] > 0
    measured = Calibration(
        {32: 100_000.0},
        learner_rate=20_000.0,
        steps_per_update=2048,
        fragment_steps=2048,
        seconds=0.0,
        optimizer_steps_per_update=16,
        parameters=10_000,
        sync_latency_s=costs["allreduce_latency_s"] / 2,
        sync_bytes_per_s=costs["allreduce_bytes_per_s"],
        sync_measured=True,
    )
    # two learners: each optimizer step pays the all_reduce the probe timed (its latency, the bucket at its bandwidth)
    update_s = 2048 / 20_000.0
    assert plan.group_learner_rate(measured, 2, "allreduce") == pytest.approx(
        2048 / (update_s + 16 * (costs["allreduce_latency_s"] + 40_000 / costs["allreduce_bytes_per_s"])), rel=1e-6
    )
    slower = dataclasses.replace(measured, sync_bytes_per_s=measured.sync_bytes_per_s / 100)
    assert plan.group_learner_rate(slower, 4, "allreduce") < plan.group_learner_rate(measured, 4, "allreduce")
    assert "learner group (measured" in plan.format_table(measured, [], cores=8)


def cluster_calibration():
    rates = {k: 2_000.0 * k for k in (4, 8, 16, 32, 64, 128)}
    return Calibration(
        rates,
        learner_rate=30_000.0,
        steps_per_update=2048,
        fragment_steps=512,
        seconds=0.0,
        optimizer_steps_per_update=16,
        parameters=1_000_000,
        sync_latency_s=100e-6,
        sync_bytes_per_s=1e9,
        sync_measured=True,
    )


def test_the_cluster_what_if_runs_a_layout_per_node_and_prices_the_link():
    cal, cfg = cluster_calibration(), config(bound=100)
    one = plan.predict_cluster(cal, cfg, 1, 40, link_bytes_per_s=1.25e9, link_latency_s=50e-6)
    eight = plan.predict_cluster(cal, cfg, 8, 40, link_bytes_per_s=1.25e9, link_latency_s=50e-6)
    assert one.group == one.per_node.learners and eight.group == 8 * eight.per_node.learners
    assert one.env_steps_per_s < eight.env_steps_per_s <= 8 * one.env_steps_per_s
    # a slow link makes every allreduce step expensive: fewer env steps/s than over a fast one
    slow = plan.predict_cluster(cal, cfg, 8, 40, link_bytes_per_s=1.25e7, link_latency_s=50e-6)
    assert slow.env_steps_per_s < eight.env_steps_per_s
    # parameter averages overlap training: the link does not slow the learners
    average = config(bound=100)
    average = average.model_copy(update={"sync": average.sync.model_copy(update={"mode": "average"})})
    assert plan.predict_cluster(cal, average, 8, 40, 1.25e7, 50e-6).env_steps_per_s == pytest.approx(
        8 * plan.predict_cluster(cal, average, 1, 40, 1.25e7, 50e-6).env_steps_per_s
    )
    table = plan.format_cluster(cal, [one, eight], 1.25e9, 50e-6, "allreduce")
    assert "10 Gbit/s" in table and "measured" in table and table.count("\n") == 3
    assert "max lag" in table.splitlines()[1] and table.splitlines()[2].split()[-1] == f"{one.per_node.max_lag:.1f}"


def test_under_an_auto_bound_each_layouts_lag_is_capped_where_the_controller_settles_on_it():
    """The planner predicts lag by the controller's rule: with many actors per learner the lag of plain
    credits is far above the smallest bound that keeps them producing, where auto stops raising it."""
    cal = synthetic({8: 10_000.0}, learner_rate=30_000.0, fragment_steps=1024, steps_per_update=2048)
    space = Space(envs=[8], actors=[1, 2, 4, 8], fragment_steps=1024, preferred_envs=8)
    auto = load_config("cartpole-ppo", ["balance.max_policy_lag=auto", "balance.max_inflight=4"])
    for layout in predict(cal, auto, space, cores=16):
        settled = plan.settled_bound(cal, layout)
        assert layout.max_lag <= settled and not layout.held_back, (layout, settled)
    many = {layout.actors: layout for layout in predict(cal, auto, space, cores=16)}[8]
    assert many.max_lag == plan.settled_bound(cal, many) < LagController.high  # capped by the rule, not the ceiling
    cluster = plan.predict_cluster(cluster_calibration(), auto, 4, 40, 1.25e9, 50e-6)
    assert cluster.per_node.max_lag <= plan.settled_bound(cluster_calibration(), cluster.per_node)


def test_the_cluster_mode_lays_out_a_described_cluster_and_says_why():
    nodes = [{"CPU": 40.0, "GPU": 0.0}, {"CPU": 40.0}, {"CPU": 8.0}, {"CPU": 1.0}]  # as ray.nodes() lists them
    layouts, total, why = plan.plan_cluster(cluster_calibration(), config(bound=100), nodes, 1.25e9, 50e-6)
    assert len(layouts) == 3 and layouts[0] == layouts[1] and layouts[2].learners <= 4  # the 1-CPU node is left out
    assert total == pytest.approx(sum(layout.env_steps_per_s for layout in layouts))
    assert "2 node(s) of 40 CPUs" in why and "1 node(s) of 8 CPUs" in why and "1 node(s) with fewer than 2 CPUs" in why
    with pytest.raises(ValueError, match="2 CPUs"):
        plan.plan_cluster(cluster_calibration(), config(), [{"CPU": 1.0}], 1.25e9, 50e-6)
    # with a GPU learner's rate, the node that has a GPU trains on it: one learner there
    layouts, _, why = plan.plan_cluster(
        cluster_calibration(), config(bound=100), nodes, 1.25e9, 50e-6, gpu_learner_rate=1e6
    )
    assert layouts[0] == layouts[1] and layouts[0].learners > 1  # node 0 lists "GPU": 0.0, node 1 none: CPUs
    with_gpu = [{"CPU": 40.0, "GPU": 1.0}, {"CPU": 40.0}]
    layouts, _, why = plan.plan_cluster(
        cluster_calibration(), config(bound=100), with_gpu, 1.25e9, 50e-6, gpu_learner_rate=1e6
    )
    assert layouts[0].learners == 1 and "1 node(s) of 40 CPUs and a GPU: 1 learner(s) on the GPU" in why
    # unlike nodes: each kind's collectives are priced with the group the others really form
    group = sum(layout.learners for layout in layouts)
    alone = plan.predict_cluster(
        cluster_calibration(), config(bound=100), 2, 40, 1.25e9, 50e-6, 1e6, others_in_group=group - 1
    ).per_node
    assert layouts[0] == alone


def test_a_process_shares_the_cores_with_the_others_that_want_one():
    assert plan.core_share([(1, 1.0)], cores=1) == pytest.approx((0.5, 1.0))  # one other, always running
    assert plan.core_share([(3, 0.0)], cores=1) == pytest.approx((1.0, 0.0))  # others idle: a core of its own
    # two others, each busy half the time, on 2 cores: only when both run (1/4) does it get 2/3 of a core
    speed, taken = plan.core_share([(1, 0.5), (1, 0.5)], cores=2)
    assert speed == pytest.approx(0.75 + 0.25 * 2 / 3) and taken == pytest.approx(0.25)
    # a collective waits for the slowest: each of two learners takes 1.5 steps' time a quarter of the time
    assert plan.slowest_step([(1, 0.5), (1, 0.5)], cores=2, members=1) == pytest.approx(0.75 + 0.25 * 1.5)
    assert plan.slowest_step([(1, 0.5), (1, 0.5)], cores=2, members=2) == pytest.approx(0.75**2 + (1 - 0.75**2) * 1.5)
    assert plan.slowest_step([(3, 0.0)], cores=1, members=8) == pytest.approx(1.0)
    assert calibration.efficiency_at(0.7, 1.0, 4) == 1.0 and calibration.efficiency_at(0.7, 4.0, 4) == pytest.approx(
        0.7
    )
    assert calibration.efficiency_at(0.7, 2.5, 4) == pytest.approx(0.85)


def test_more_processes_than_cores_and_busy_cores_slow_a_layout_down():
    cal = Calibration(
        {32: 100_000.0},
        learner_rate=20_000.0,
        steps_per_update=2048,
        fragment_steps=2048,
        seconds=0.0,
        optimizer_steps_per_update=16,
        parameters=10_000,
        sync_latency_s=100e-6,
        sync_bytes_per_s=1e9,
    )

    def rate(cal, learners, actors, cores, mode="allreduce"):
        return plan.shared_throughput(cal, 100_000.0, actors, actors, learners, learners, mode, cores)[0]

    # room for everyone: the plain bounds (two learners at their group rate)
    assert rate(cal, 2, 2, 4) == pytest.approx(2 * plan.group_learner_rate(cal, 2, "allreduce"))
    # 4 processes on 2 cores: the learners get part of a core, and under allreduce each of their
    # messages may wait for a core: slower than parameter averages, which do not wait for each other
    crowded, averaging = rate(cal, 2, 2, 2), rate(cal, 2, 2, 2, "average")
    assert crowded < averaging < 2 * 20_000
    # cores that slow each other down when all are busy: a layout that keeps both busy loses speed
    slow_cores = dataclasses.replace(cal, core_efficiency=0.7)
    assert rate(slow_cores, 2, 2, 4) < rate(cal, 2, 2, 4)
    assert rate(slow_cores, 1, 1, 2) > 0.7 * rate(cal, 1, 1, 2)  # the actor keeps its core busy only in part


def test_the_cores_efficiency_is_measured_with_the_learner_on_every_core():
    cfg = config()
    layout = calibration.with_layout(cfg, 1, 32, 2048)
    efficiency = calibration.measure_core_efficiency(layout, 2, seconds=0.3)
    assert 0 < efficiency <= 1  # measured alone and on both cores, in forked copies
    assert calibration.measure_core_efficiency(layout, 1) == 1.0  # one core: nothing to share


def test_the_cluster_what_if_with_one_gpu_learner_per_node():
    cal, cfg = cluster_calibration(), config(bound=100)
    average = cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"mode": "average"})})
    cpu = plan.predict_cluster(cal, average, 4, 40, 1.25e9, 50e-6)
    gpu = plan.predict_cluster(cal, average, 4, 40, 1.25e9, 50e-6, gpu_learner_rate=1e9)  # keeps up with any actors
    assert gpu.per_node.learners == 1 and gpu.group == 4
    assert gpu.env_steps_per_s > cpu.env_steps_per_s and gpu.per_node.idle_side == "learner"
    # under allreduce a lone GPU learner per node still pays every step's collective over the link
    assert (
        plan.predict_cluster(cal, cfg, 4, 40, 1.25e9, 50e-6, gpu_learner_rate=1e9).env_steps_per_s < gpu.env_steps_per_s
    )
    slow = plan.predict_cluster(cal, cfg, 4, 40, 1.25e9, 50e-6, gpu_learner_rate=10_000.0)
    assert slow.env_steps_per_s <= 4 * 10_000 + 1e-6  # a slow GPU bounds each node
    table = plan.format_cluster(cal, [gpu], 1.25e9, 50e-6, "allreduce", gpu_learner_rate=1e9)
    assert "one GPU learner per node" in table


def test_two_learners_training_as_a_group_price_each_collective_message():
    # each step of the group takes 5 ms more than alone; less the bucket's 1 ms, over two messages
    assert calibration.message_latency(1_000.0, 2_000.0, 100.0, 10.0, 0.001, probed=0.0) == pytest.approx(0.002)
    assert (
        calibration.message_latency(1_000.0, 2_000.0, 100.0, 10.0, 0.001, probed=0.003) == 0.003
    )  # never below the probe
    layout = calibration.with_layout(config(), 1, 32, 2048)
    rate = calibration.measure_group_training(layout, updates_per_s=10.0, seconds=0.3)  # two forked learners, gloo
    assert rate > 0


def test_the_plan_command_prints_the_table_the_choice_and_the_cluster_what_if(monkeypatch, capsys):
    """`tianji plan` end to end on measured rates (the calibration itself is tested above)."""
    calls = []

    def fake_calibrate(cfg, space, group=False):
        calls.append(group)
        return cluster_calibration()

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    assert cli.main(["plan", "cartpole-ppo", "--cores", "8"]) == 0
    out = capsys.readouterr().out
    assert "calibrating cartpole-ppo on this machine" in out and "chosen: --set topology.learners=" in out
    assert cli.main(["plan", "cartpole-ppo", "--cores", "8", "--nodes", "4"]) == 0
    assert "learner group of two" in capsys.readouterr().out
    assert calls == [False, True]
    assert cli.main(["plan", "cartpole-ppo", "--cores", "8", "--set", "balance.max_policy_lag=auto"]) == 0
    assert "auto settles near" in capsys.readouterr().out
    for bad in (["--nodes", "0"], ["--nodes", "2", "--link-gbit", "0"]):
        assert cli.main(["plan", "cartpole-ppo", *bad]) == 2
        assert "--link-latency-us: zero or more" in capsys.readouterr().err
    assert cli.main(["plan", "cartpole-ppo", "--gpu-learner-rate", "1e6"]) == 2
    assert "only with --nodes N or --cluster" in capsys.readouterr().err


def test_under_an_auto_bound_the_plan_starts_the_controller_where_it_would_settle(tmp_path, monkeypatch, tiny_config):
    monkeypatch.setenv("TIANJI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(plan, "_calibrate_in_child", lambda cfg, space: synthetic({2: 4000.0, 4: 8000.0}, 3000.0))
    raw = tiny_config().model_dump(mode="json")
    raw["topology"]["actors"] = "auto"
    raw["balance"]["max_policy_lag"] = "auto"
    planned, record = plan.resolve_layout(load_config("cartpole-ppo", []).model_validate(raw), cores=4)
    chosen = plan.Layout(**record["chosen"])
    assert planned.balance.lag_is_auto and planned.balance.lag_start == record["lag_start"]
    assert record["lag_start"] == plan.settled_bound(synthetic({2: 4000.0, 4: 8000.0}, 3000.0), chosen) >= 1
    assert not chosen.held_back  # the controller may raise the bound to what the layout needs


def test_a_hand_set_layout_that_crowds_the_cores_is_warned_about():
    crowded = oversubscription_warning(load_config("pong-appo", ["topology.actors=16"]), cores=2)
    assert crowded is not None
    assert "16 actors x 1 thread(s) on 2 cores" in crowded and "1/8 of a core" in crowded
    assert "tianji plan pong-appo" in crowded
    assert oversubscription_warning(load_config("pong-appo", []), cores=2) is None  # 2 actors, a learner
    assert oversubscription_warning(load_config("pong-appo", ["topology.actors=4"]), cores=2) is None
