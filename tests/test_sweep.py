"""`tianji sweep`: search spaces and their checks, the objective's direction and penalty, best.yaml, and
the search loop with fake trials (a tiny script that writes metrics rows and a summary like a run):
pruning, a crashed and a hung trial, Ctrl-C and resume. One short real sweep of CartPole PPO."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
import yaml

from tianji.config import ConfigError, apply_overrides, build_config, load_config, load_raw
from tianji.tools.sweep.objective import Objective
from tianji.tools.sweep.report import best_config_text
from tianji.tools.sweep.space import check_space, override, parse_param, parse_space, resolve_space
from tianji.tools.sweep.study import Sweep, SweepConsole, SweepSettings, core_slots, create_sweep
from tianji.tools.sweep.trial import TrialProcess, train_command

from conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- spaces


def test_every_distribution_parses_from_the_command_line_and_from_yaml():
    lr = parse_param("algo.lr=loguniform:1e-4:3e-3")
    assert (lr.kind, lr.low, lr.high) == ("loguniform", 1e-4, 3e-3)
    assert lr.distribution() == optuna.distributions.FloatDistribution(1e-4, 3e-3, log=True)
    assert parse_param("algo.clip=uniform:0.1:0.3:0.05").distribution() == optuna.distributions.FloatDistribution(
        0.1, 0.3, step=0.05
    )
    assert parse_param("algo.epochs=int:2:8").distribution() == optuna.distributions.IntDistribution(2, 8)
    assert parse_param("topology.envs_per_actor=int:8:64:log").distribution() == optuna.distributions.IntDistribution(
        8, 64, log=True
    )
    assert parse_param("algo.minibatches=categorical:2,4,8").choices == (2, 4, 8)
    hidden = parse_param("algo.hidden=categorical:[[64, 64], [128, 128]]")
    assert hidden.choices == ([64, 64], [128, 128])
    assert hidden.value(hidden.distribution().choices[1]) == [128, 128]  # JSON text in Optuna, a list in the config
    from_yaml = parse_space(
        yaml.safe_load("""
        algo.lr: {type: loguniform, low: 1.0e-4, high: 3.0e-3}
        algo.epochs: {type: int, low: 2, high: 8, step: 2}
        algo.minibatches: "categorical:2,4"
    """),
        "test",
    )
    assert [p.kind for p in from_yaml] == ["loguniform", "int", "categorical"]
    assert from_yaml[1].distribution() == optuna.distributions.IntDistribution(2, 8, step=2)
    assert [parse_space({p.key: p.to_dict()}, "again")[0] for p in from_yaml] == from_yaml  # sweep.json round trip


@pytest.mark.parametrize(
    "text, message",
    [
        ("algo.lr", "expected KEY.PATH=KIND:ARGS"),
        ("algo.lr=gaussian:0:1", "expected loguniform|uniform|int|categorical"),
        ("algo.lr=loguniform:0:1", "loguniform needs low > 0"),
        ("algo.lr=uniform:0.3:0.1", "low must be below high"),
        ("algo.epochs=int:2.5:8", "int needs whole numbers"),
        ("algo.lr=uniform:a:1", "low must be a number"),
        ("algo.lr=loguniform:1e-4:1e-2:1e-4", "loguniform cannot have a step"),
    ],
)
def test_bad_parameters_name_the_field_and_what_was_expected(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_param(text)
    assert text.split("=")[0] in str(info.value)


def test_the_space_is_checked_against_the_real_config_before_anything_starts():
    base = load_raw("cartpole-ppo")
    check_space(base, [parse_param("algo.lr=loguniform:1e-4:3e-3"), parse_param("algo.hidden=categorical:[[8],[8,8]]")])
    with pytest.raises(ConfigError, match=r"search space algo\.lrr: .*algo\.lrr: unknown field"):
        check_space(base, [parse_param("algo.lrr=loguniform:1e-4:3e-3")])
    with pytest.raises(ConfigError, match=r"search space topology\.actors: the value 0 .*greater than or equal to 1"):
        check_space(base, [parse_param("topology.actors=int:0:4")])
    with pytest.raises(ConfigError, match="no search space"):
        resolve_space("cartpole-dqn", None, [])


def test_a_space_beside_the_config_or_bundled_with_the_preset_is_the_default(tmp_path):
    assert {p.key for p in resolve_space("cartpole-ppo", None, [])} >= {"algo.lr", "algo.epochs"}
    config = tmp_path / "my.yaml"
    config.write_text("algo: {name: ppo}\n")
    (tmp_path / "my.space.yaml").write_text("algo.lr: loguniform:1e-4:1e-3\nalgo.epochs: int:1:4\n")
    assert {p.key: p.high for p in resolve_space(str(config), None, [])} == {"algo.lr": 1e-3, "algo.epochs": 4}
    space = resolve_space(str(config), str(tmp_path / "my.space.yaml"), ["algo.epochs=int:2:3"])
    assert {p.key: p.high for p in space} == {"algo.lr": 1e-3, "algo.epochs": 3}  # --param replaces the file's entry
    assert [p.key for p in resolve_space(str(config), None, ["algo.clip=uniform:0.1:0.3"])] == ["algo.clip"]


def test_overrides_read_back_as_the_same_values():
    for value in (1e-05, 0.25, 3, [64, 64], "true", None, {"a": 1e-7}):
        assert apply_overrides({}, [override("x", value)])["x"] == value  # 1e-05 would be a string in YAML 1.1


# ---------------------------------------------------------------- objective


def test_time_to_target_is_minimised_and_a_missed_target_ranks_below_every_reached_one():
    cfg = load_config("cartpole-ppo", ["stop.max_wall_time_s=60"])
    objective = Objective.of(cfg)
    assert (objective.name, objective.direction) == ("time_to_target", "minimize")
    assert objective.final({"target_reached": True, "time_to_target_s": 7.5}) == 7.5
    missed_close = objective.final({"target_reached": False, "final_return_mean100": 427.5})
    missed_far = objective.final({"target_reached": False, "final_return_mean100": 0.0})
    assert missed_close == pytest.approx(60 * (1 + 47.5 / 475)) and missed_far == pytest.approx(120)
    assert 60 < missed_close < missed_far
    assert objective.final({"target_reached": False}) == 120  # no episode ended
    assert objective.intermediate({"time_s": 9.0, "env/episodes": 150, "env/return_mean100": 480}) == 9.0
    assert objective.intermediate({"time_s": 9.0, "env/episodes": 50, "env/return_mean100": 480}) == 60  # < 100 eps
    assert objective.intermediate({"time_s": 3.0, "env/return_mean100": float("nan")}) == 120


def test_other_objectives_are_maximised_and_need_what_they_read():
    cfg = load_config("cartpole-ppo")
    final = Objective.of(cfg, "final_return")
    assert final.direction == "maximize" and final.final({"final_return_mean100": 321.0}) == 321.0
    assert final.intermediate({"env/return_mean100": float("nan")}) is None
    with pytest.raises(ConfigError, match="eval.interval_s"):
        Objective.of(cfg, "eval_win_rate")
    with pytest.raises(ConfigError, match="stop.target_return"):
        Objective.of(load_config("cartpole-ppo", ["stop.target_return=null"]), "time_to_target")
    with pytest.raises(ConfigError, match="wall-time budget"):
        Objective.of(load_config("cartpole-ppo", ["stop.max_wall_time_s=null", "stop.max_env_steps=1000"]))
    assert Objective.of(load_config("cartpole-ppo", ["stop.target_return=null"])).name == "final_return"


def test_best_yaml_is_the_base_config_with_the_best_values():
    base = load_raw("cartpole-ppo")
    params = [parse_param("algo.lr=loguniform:1e-4:3e-3"), parse_param("algo.hidden=categorical:[[8],[16,16]]")]
    study = optuna.create_study()
    trial = study.ask()
    for p in params:
        p.suggest(trial)
    study.tell(trial, 5.0)
    text = best_config_text(base, params, study.best_trial, Objective.of(load_config("cartpole-ppo")))
    cfg = build_config(yaml.safe_load(text))
    assert cfg.algo.lr == study.best_trial.params["algo.lr"] and list(cfg.algo.hidden) in ([8], [16, 16])
    assert cfg.algo.epochs == load_config("cartpole-ppo").algo.epochs  # the rest as in the base


def test_each_parallel_trial_gets_its_own_cores():
    assert core_slots(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert core_slots(1, [0, 1]) == [] and core_slots(4, [0, 1]) == []


def test_a_ray_trial_keeps_its_roles_on_one_node(tmp_path):
    settings = SweepSettings(
        config="cartpole-ppo",
        space={"algo.lr": "loguniform:1e-4:1e-3"},
        trials=1,
        overrides=["stop.max_wall_time_s=30"],
        launcher="ray",
        address="10.0.0.1:6379",
        parallel=4,
    )
    create_sweep(settings, tmp_path / "sw")
    saved = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert "ray.strategy=STRICT_PACK" in saved["trial_overrides"] and saved["cores_per_trial"] == []
    command = train_command(
        tmp_path / "sw" / "base.yaml",
        tmp_path / "sw" / "trials" / "0000",
        saved["trial_overrides"] + [override("algo.lr", 3e-4)],
        "ray",
        "10.0.0.1:6379",
    )
    assert command[1:] == [
        "-m",
        "tianji",
        "train",
        str(tmp_path / "sw" / "base.yaml"),
        "--run-dir",
        str(tmp_path / "sw" / "trials" / "0000"),
        "--launcher",
        "ray",
        "--address",
        "10.0.0.1:6379",
        "--set",
        "logging.console=false",
        "--set",
        "ray.strategy=STRICT_PACK",
        "--set",
        "algo.lr=0.0003",
    ]
    load_config(str(tmp_path / "sw" / "base.yaml"), list(command[-5::2]))  # every --set is a valid field
    own = SweepSettings(
        config="cartpole-ppo",
        space={"algo.lr": "loguniform:1e-4:1e-3"},
        trials=1,
        launcher="ray",
        overrides=["stop.max_wall_time_s=30", "ray.strategy=SPREAD"],
    )
    create_sweep(own, tmp_path / "own")
    assert "ray.strategy=STRICT_PACK" not in own.trial_overrides  # the trial asked otherwise


# ---------------------------------------------------------------- the loop, with fake trials

FAKE_TRAIN = textwrap.dedent("""
    # A stand-in for `tianji train`: rows of a run whose return grows at SPEED per (simulated) second.
    import json, os, signal, sys, time
    run_dir, mode, speed, budget = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    os.makedirs(run_dir, exist_ok=True)
    done = {"stop": False}
    signal.signal(signal.SIGINT, lambda *a: done.update(stop=True))
    signal.signal(signal.SIGTERM, lambda *a: done.update(stop=True))
    if mode == "hang":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        time.sleep(1000)
    metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    start = 0
    state_path = os.path.join(run_dir, "checkpoints", "driver.json")
    if os.path.exists(state_path):
        start = json.load(open(state_path))["t"]
    reason, reached, value = "max_wall_time_s", None, 0.0
    for t in range(start + 1, budget + 1):
        value = min(500.0, speed * t)
        metrics.write(json.dumps({"time_s": t, "env_steps": 1000 * t, "env/episodes": 200,
                                  "env/return_mean100": value}) + "\\n")
        metrics.flush()
        if mode == "crash" and t == 2:
            sys.exit(3)
        if value >= 475:
            reason, reached = "target_return", t
            break
        time.sleep(0.03)
        if done["stop"]:
            reason = "interrupted"
            break
    os.makedirs(os.path.dirname(state_path), exist_ok=True)
    json.dump({"t": t}, open(state_path, "w"))
    open(os.path.join(run_dir, "checkpoints", "learner.pt"), "wb").write(b"fake")  # a checkpoint to resume from
    json.dump({"target_reached": reached is not None, "time_to_target_s": reached, "final_return_mean100": value,
               "env_steps": 1000 * t, "wall_time_s": t, "stop_reason": reason},
              open(os.path.join(run_dir, "summary.json"), "w"))
""")


def fake_factory(tmp_path: Path, behaviour, budget: int = 40):
    """Process factory for Sweep: trial N runs the fake with behaviour(N) = (mode, speed)."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)

    def make(command, run_dir, cores):
        mode, speed = behaviour(int(Path(run_dir).name))
        return TrialProcess([sys.executable, str(script), str(run_dir), mode, str(speed), str(budget)], run_dir, cores)

    return make


def new_sweep(tmp_path: Path, trials: int, **settings) -> Path:
    settings = {"report_every": "2s", "grace_s": 2.0, "silent_s": 60.0, "seed": 0, **settings}
    return create_sweep(
        SweepSettings(
            config="cartpole-ppo",
            space={"algo.lr": "loguniform:1e-4:1e-3"},
            trials=trials,
            overrides=["stop.max_wall_time_s=40"],
            **settings,
        ),
        tmp_path / "sweep",
    )


def states(sweep: Sweep) -> dict[int, str]:
    return {t.number: t.state.name for t in sweep.study.trials}


def quiet() -> SweepConsole:
    return SweepConsole(open(os.devnull, "w"))


def test_a_hopeless_trial_is_pruned_early_and_a_fast_one_completes(tmp_path):
    sweep_dir = new_sweep(tmp_path, trials=5)
    speeds = {0: 100, 1: 120, 2: 95, 3: 5, 4: 110}  # trial 3 would need 95 s to reach 475
    sweep = Sweep(sweep_dir, quiet(), fake_factory(tmp_path, lambda n: ("run", speeds[n])))
    assert sweep.run() == "done"
    assert states(sweep) == {0: "COMPLETE", 1: "COMPLETE", 2: "COMPLETE", 3: "PRUNED", 4: "COMPLETE"}
    pruned = sweep.study.trials[3]
    assert max(pruned.intermediate_values) <= 6, "pruned at one of the first report points"
    assert sweep.study.best_trial.number == 1 and sweep.study.best_value == 4  # 120/s reaches 475 at t=4
    rows = (sweep_dir / "sweep.csv").read_text().splitlines()
    assert rows[1].startswith("1,COMPLETE,4") and rows[-1].startswith("3,PRUNED")
    assert (sweep_dir / "best.yaml").exists() and (sweep_dir / "history.png").exists()


def test_a_crashed_and_a_hung_trial_are_recorded_as_failed_and_the_sweep_goes_on(tmp_path):
    sweep_dir = new_sweep(tmp_path, trials=3, silent_s=1.5, pruner="none")
    modes = {0: ("crash", 100), 1: ("hang", 100), 2: ("run", 100)}
    sweep = Sweep(sweep_dir, quiet(), fake_factory(tmp_path, modes.__getitem__))
    assert sweep.run() == "done"
    assert states(sweep) == {0: "FAIL", 1: "FAIL", 2: "COMPLETE"}
    assert sweep.study.trials[0].user_attrs["note"].startswith("exit code 3")
    assert "hung" in sweep.study.trials[1].user_attrs["note"]


def test_ctrl_c_leaves_a_consistent_study_and_resume_continues_the_interrupted_trial(tmp_path):
    sweep_dir = new_sweep(tmp_path, trials=2, pruner="none")
    speeds = {0: 100, 1: 12, 2: 12}  # trial 1 runs about 1.2 s (40 rows); trial 2 continues it
    sweep = Sweep(sweep_dir, quiet(), fake_factory(tmp_path, lambda n: ("run", speeds[n])))
    sent = []

    def step_then_interrupt_during_trial_1(r):
        original_step(r)
        if 1 in sweep.running and sweep.running[1].last_row and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the terminal

    original_step = sweep.step
    sweep.step = step_then_interrupt_during_trial_1
    assert sweep.run() == "interrupted"
    interrupted = sweep.study.trials[1]
    assert interrupted.state.name == "FAIL" and interrupted.user_attrs["interrupted"]
    assert json.loads((sweep_dir / "trials" / "0001" / "summary.json").read_text())["stop_reason"] == "interrupted"

    resumed = Sweep(sweep_dir, quiet(), fake_factory(tmp_path, lambda n: ("run", speeds[n])))
    assert resumed.run() == "done"
    retry = resumed.study.trials[2]
    assert retry.state.name == "COMPLETE" and retry.params == interrupted.params
    assert retry.user_attrs["retry_of"] == 1 and retry.user_attrs["continue_run"] == "trials/0001"
    assert retry.value == 40, "continued from its checkpoint: time to target counts the first part too"
    assert [t.number for t in resumed.finished()] == [0, 2]


def test_a_trial_left_running_by_a_crashed_sweep_is_failed_and_run_again(tmp_path):
    sweep_dir = new_sweep(tmp_path, trials=1, pruner="none")
    crashed = Sweep(sweep_dir, quiet())
    trial = crashed.study.ask()  # the sweep died after starting trial 0: RUNNING in the study, no run dir
    crashed.params[0].suggest(trial)
    resumed = Sweep(sweep_dir, quiet(), fake_factory(tmp_path, lambda n: ("run", 100)))
    assert resumed.run() == "done"
    assert states(resumed) == {0: "FAIL", 1: "COMPLETE"}
    assert resumed.study.trials[1].params == resumed.study.trials[0].params
    assert "continue_run" not in resumed.study.trials[1].user_attrs  # nothing to continue from


# ---------------------------------------------------------------- a real sweep


def test_sweep_of_cartpole_ppo_end_to_end(tmp_path):
    """Two real trials of `tianji train cartpole-ppo` through the CLI, each to a return of 150 (seconds)."""
    sweep_dir = tmp_path / "sw"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tianji",
            "sweep",
            "cartpole-ppo",
            "--trials",
            "2",
            "--param",
            "algo.lr=loguniform:7e-4:1.5e-3",
            "--param",
            "algo.epochs=int:3:4",
            "--trial-seconds",
            "40",
            "--sweep-dir",
            str(sweep_dir),
            "--set",
            "logging.tensorboard=false",
            "--set",
            "stop.target_return=150",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sweep trials, best first" in out.stdout and "best config:" in out.stdout
    for name in ("sweep.csv", "best.yaml", "history.png", "importance.png", "study.journal", "base.yaml"):
        assert (sweep_dir / name).is_file(), name
    for trial in ("0000", "0001"):
        run = sweep_dir / "trials" / trial
        assert {"config.yaml", "summary.json", "metrics.csv", "train.log"} <= {p.name for p in run.iterdir()}
    best = load_config(str(sweep_dir / "best.yaml"))
    rows = (sweep_dir / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("trial,state,time_to_target,algo.lr,algo.epochs")
    best_row = rows[1].split(",")
    assert best_row[1] == "COMPLETE" and float(best_row[3]) == best.algo.lr and int(best_row[4]) == best.algo.epochs


def test_settings_that_would_stop_every_trial_are_refused(tmp_path):
    for bad, message in (
        ({"max_minutes": 0}, "--max-minutes"),
        ({"silent_s": 0}, "--silent-s"),
        ({"grace_s": -1}, "--grace-s"),
    ):
        with pytest.raises(ConfigError, match=message):
            new_sweep(tmp_path / str(len(message)), trials=1, **bad)


def test_a_missed_target_keeps_its_penalised_value_at_later_report_points(tmp_path):
    sweep = Sweep(new_sweep(tmp_path, trials=1), quiet())
    reached, missed = 4.0, sweep.objective.penalised(300.0)  # budget 40 s
    assert sweep.value_at(2, reached) == sweep.objective.penalised(sweep.objective.target)  # not there yet at 2 s
    assert sweep.value_at(6, reached) == reached
    assert sweep.value_at(2, missed) == missed  # never "nearly there": what it ended with


def test_a_sweep_resumed_where_its_trials_cores_do_not_exist_pins_them_to_cores_that_do(tmp_path):
    sweep_dir = new_sweep(tmp_path, trials=1)
    saved = json.loads((sweep_dir / "sweep.json").read_text())
    saved.update(parallel=2, cores_per_trial=[[998], [999]])  # as written on a bigger machine
    (sweep_dir / "sweep.json").write_text(json.dumps(saved))
    slots = Sweep(sweep_dir, quiet()).settings.cores_per_trial
    here = os.sched_getaffinity(0)
    assert all(set(slot) <= here for slot in slots) and slots == core_slots(2, sorted(here))


@pytest.mark.slow
def test_sweep_resume_through_the_command_line_continues_the_interrupted_trial_only(tmp_path):
    """`tianji sweep` interrupted (SIGINT) while its second trial trains, then `tianji sweep --resume DIR`: the
    interrupted trial runs again with `tianji train --resume` in its own directory, the finished one does not
    run again, and the sweep ends with every trial done."""
    sweep_dir = tmp_path / "sweep"
    base = [sys.executable, "-m", "tianji", "sweep"]
    first = subprocess.Popen(
        [
            *base,
            "cartpole-ppo",
            "--param",
            "algo.lr=loguniform:5e-4:1e-3",
            "--trials",
            "2",
            "--pruner",
            "none",
            "--sweep-dir",
            str(sweep_dir),
            "--set",
            "stop.target_return=null",
            "--trial-seconds",
            "12",
            "--report-every",
            "2s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    second_trial = sweep_dir / "trials" / "0001"
    try:
        assert wait_for(
            lambda: (
                (second_trial / "metrics.csv").exists()
                and len((second_trial / "metrics.csv").read_text().splitlines()) > 3
            ),
            120,
        ), "the second trial did not start"
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the sweep's process group
        output, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, output
    finished = sweep_dir / "trials" / "0000"
    finished_rows = (finished / "metrics.csv").read_text()
    assert json.loads((second_trial / "summary.json").read_text())["stop_reason"] == "interrupted"

    resumed = subprocess.run([*base, "--resume", str(sweep_dir)], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert list(second_trial.glob("meta-resume-*.json")), "the interrupted trial was not resumed in its directory"
    meta = json.loads(next(second_trial.glob("meta-resume-*.json")).read_text())
    assert "--resume" in meta["argv"] and str(second_trial) in " ".join(meta["argv"])
    assert not list(finished.glob("meta-resume-*.json")) and (finished / "metrics.csv").read_text() == finished_rows
    assert not (sweep_dir / "trials" / "0002").exists() or not list((sweep_dir / "trials" / "0002").glob("*.csv")), (
        "the resumed trial went on in its own directory, not a new one"
    )
