"""Command line: `tianji train`, `plan`, `sweep`, `plot`, `eval`, `presets`. Imports of the rest of TianJi wait
inside the functions, so `train --launcher ray` can start Ray before torch loads (see `_boot_ray_if_asked`)."""

from __future__ import annotations

import time

T0 = time.time()  # command start, before heavy imports: time-to-target counts from here

import argparse  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tianji.runtime.launchers.ray_boot import boot_early  # noqa: E402  (no torch)


def _config_help() -> str:
    from tianji.config import describe_fields

    lines = ["config fields (set with --set key.path=value):"]
    for key, default, doc in describe_fields():
        lines.append(f"  {key:<30} {doc} [default: {default}]")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tianji", description="Highly parallel deep RL training.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train an agent", epilog=_config_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    train.add_argument("config", nargs="?", help="preset name (see `tianji presets`) or path to a YAML config")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config field, e.g. --set topology.actors=2 (repeatable)",
    )
    train.add_argument("--run-dir", help="run directory (default: <logging.run_root>/<name>-<timestamp>)")
    train.add_argument(
        "--launcher",
        choices=["local", "inline", "ray"],
        default="local",
        help="local: one process per role on this machine (default); inline: all roles in this "
        "process; ray: roles as Ray actors on a cluster (pip install 'tianji[ray]')",
    )
    train.add_argument(
        "--address", help="with --launcher ray: the Ray cluster to join ('auto' or HOST:PORT; sets ray.address)"
    )
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")

    plan = sub.add_parser("plan", help="measure actor and learner rates and choose a layout (actors, envs per actor)")
    plan.add_argument("config", help="preset name or path to a YAML config")
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config field (repeatable)",
    )
    plan.add_argument(
        "--cores",
        type=int,
        default=None,
        help="plan for a machine with this many cores (default: the cores available here)",
    )
    plan.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="what-if: predict clusters of 1, 2, 4, ... up to this "
        "many machines like this one (rates measured here), learners in one group across them",
    )
    plan.add_argument(
        "--cores-per-node",
        type=int,
        default=None,
        help="what-if: cores of each machine (default: --cores, or the cores here)",
    )
    plan.add_argument(
        "--cluster",
        action="store_true",
        help="lay out the whole Ray cluster (ray.address, or the "
        "one `ray start` made here): every node's CPUs, the rates measured on this machine",
    )
    plan.add_argument("--link-gbit", type=float, default=10.0, help="what-if: network between machines, Gbit/s")
    plan.add_argument(
        "--gpu-learner-rate",
        type=float,
        default=None,
        help="with --nodes or --cluster: one "
        "learner per node on a GPU (--cluster: per node that has one) that consumes this many env "
        "steps/s (measure it on a GPU machine: tianji plan PRESET --set learner.device=cuda)",
    )
    plan.add_argument(
        "--link-latency-us",
        type=float,
        default=50.0,
        help="what-if: one message's latency between machines, microseconds",
    )

    plot = sub.add_parser(
        "plot",
        help="learning curves: one run into RUN_DIR/curve.png, several runs overlaid in one picture (needs matplotlib)",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    plot.add_argument("--out", help="where the picture of several runs goes (default: curves.png here)")
    plot.add_argument("--title", help="title of the picture of several runs")

    evaluate = sub.add_parser("eval", help="play greedy episodes with a run's last checkpoint; print the score")
    evaluate.add_argument("run_dir", help="a run directory")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes to play (default 10)")
    evaluate.add_argument("--video", metavar="FILE", help="record the first episode as .mp4 or .gif")
    evaluate.add_argument(
        "--video-view",
        choices=["screen", "agent"],
        default="screen",
        help="Atari: the game's own screen in colour (default), or the frames the agent sees",
    )

    compare = sub.add_parser(
        "compare",
        help="balance.schedule deterministic: whether two runs are the same run (weights, every update's "
        "statistics, the summary but for times); exit 1 and each difference when not",
    )
    compare.add_argument("run_dirs", nargs=2, metavar="RUN_DIR", help="two run directories")

    _add_sweep_parser(sub)
    sub.add_parser("presets", help="list the bundled presets")
    return parser


def _add_sweep_parser(sub) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="hyperparameter search (Optuna): each trial an ordinary run, pruned on its stop metric",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Search config fields for the best run. The objective is the run's own stop metric: time to "
        "target (a missed target is penalised), or the final return / evaluation win rate. Trials run as "
        "`tianji train` processes in SWEEP_DIR/trials/NNNN; the study is stored in SWEEP_DIR/study.journal.",
        epilog="space: a YAML file mapping config keys to distributions (X.space.yaml beside X.yaml and the "
        "bundled tianji/presets/spaces/PRESET.yaml are used when no space is given), e.g.\n"
        "  algo.lr: {type: loguniform, low: 1.0e-4, high: 3.0e-3}\n"
        "  algo.epochs: {type: int, low: 2, high: 8}\n"
        "  algo.minibatches: {type: categorical, choices: [2, 4, 8]}\n"
        "or --param KEY=loguniform:LOW:HIGH | uniform:LOW:HIGH[:STEP] | int:LOW:HIGH[:STEP|:log] | "
        "categorical:A,B,C\n\n"
        "outputs: sweep.csv, best.yaml (tianji train best.yaml), history.png, importance.png",
    )
    sweep.add_argument("config", nargs="?", help="preset name or path to a YAML config")
    sweep.add_argument("--space", help="YAML file of the search space")
    sweep.add_argument(
        "--param",
        dest="params",
        action="append",
        default=[],
        metavar="KEY=KIND:ARGS",
        help="one searched field, e.g. algo.lr=loguniform:1e-4:3e-3 (repeatable; replaces the "
        "space file's entry for that key)",
    )
    sweep.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config field for every trial (repeatable)",
    )
    sweep.add_argument(
        "--trials", type=int, default=None, help="trials to finish (default 20; with --resume: the new total)"
    )
    sweep.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="no trial starts after this many minutes (running ones end within their own budget)",
    )
    sweep.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    sweep.add_argument(
        "--objective",
        choices=["time_to_target", "final_return", "eval_win_rate"],
        help="what a trial is worth (default: time_to_target when the config has "
        "stop.target_return, else final_return)",
    )
    sweep.add_argument("--sampler", choices=["tpe", "random"], default="tpe", help="Optuna sampler (default tpe)")
    sweep.add_argument(
        "--pruner",
        choices=["median", "halving", "none"],
        default="median",
        help="stop hopeless trials at report points: median (below the median of finished trials "
        "there) or halving (asynchronous successive halving); default median",
    )
    sweep.add_argument(
        "--report-every",
        default="5s",
        help="a report point every N seconds of a trial ('5s', the default) or every N env steps ('20000')",
    )
    sweep.add_argument("--trial-seconds", type=float, help="wall-time budget of each trial (sets stop.max_wall_time_s)")
    sweep.add_argument("--trial-env-steps", type=int, help="env-step budget of each trial (sets stop.max_env_steps)")
    sweep.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds a trial gets to stop after SIGINT "
        "before it is killed, and past its budget before it counts as hung (default 30)",
    )
    sweep.add_argument(
        "--silent-s",
        type=float,
        default=120.0,
        help="a trial that writes no metrics row for this long is hung: stopped and recorded FAIL (default 120)",
    )
    sweep.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="trials at once on this machine, each pinned to its "
        "share of the cores with the planner's layout for that share (default 1)",
    )
    sweep.add_argument(
        "--trial-layout",
        choices=["plan", "config"],
        default="plan",
        help="with --parallel > 1: plan: the layout `tianji plan --cores SHARE` picks (default); "
        "config: the config's topology as it is",
    )
    sweep.add_argument(
        "--launcher",
        choices=["local", "inline", "ray"],
        default="local",
        help="how each trial runs; ray: on the Ray cluster at --address, one trial's roles on one "
        "node (ray.strategy STRICT_PACK unless the config sets one)",
    )
    sweep.add_argument("--address", help="with --launcher ray: the Ray cluster ('auto' or HOST:PORT)")
    sweep.add_argument("--sweep-dir", help="sweep directory (default: sweeps/<name>-<timestamp>)")
    sweep.add_argument(
        "--resume",
        metavar="SWEEP_DIR",
        help="continue a sweep (interrupted trials run again from "
        "their checkpoints); only --trials and --max-minutes change on resume",
    )


def _plan(args: argparse.Namespace) -> int:
    from tianji.config import ConfigError, load_config
    from tianji.tools.calibration import available_cores, calibrate
    from tianji.tools.plan import (
        choose,
        explain,
        format_table,
        lag_warning,
        layout_space,
        mark,
        predict,
        settled_bound,
    )

    cfg = load_config(args.config, args.overrides)
    cores = args.cores or available_cores()
    if cores < 1:
        raise ConfigError("--cores: expected a positive number of cores")
    if args.nodes is not None or args.cluster:
        return _plan_cluster(args, cfg, args.cores_per_node or cores)
    if args.gpu_learner_rate is not None:
        raise ConfigError("--gpu-learner-rate: only with --nodes N or --cluster (it places a learner per node)")
    space = layout_space(cfg, cores, plan_envs=True, plan_actors=True, plan_learners=True)
    print(
        f"calibrating {args.config} on this machine: one learner, every core at once, then one actor for each of "
        f"{space.envs} envs",
        flush=True,
    )
    cal = calibrate(cfg, space)
    layouts = predict(cal, cfg, space, cores)
    chosen = choose(layouts, space.preferred_envs, cores)
    print(format_table(cal, mark(layouts, chosen), cores))
    print(explain(cal, chosen, cores, cfg.sync.mode))
    configured = [
        c
        for c in layouts
        if (c.learners, c.actors, c.envs_per_actor)
        == (cfg.topology.learners, cfg.topology.actors, cfg.topology.envs_per_actor)
    ]
    same = (chosen.learners, chosen.actors, chosen.envs_per_actor)
    others = [c for c in configured if (c.learners, c.actors, c.envs_per_actor) != same]
    for layout, which in ((chosen, "chosen"), *((c, "configured") for c in others)):
        warning = lag_warning(cal, cfg, layout)
        if warning:
            print(f"{warning} ({which} layout)")
    print(
        f"chosen: --set topology.learners={chosen.learners} --set topology.actors={chosen.actors} "
        f"--set topology.envs_per_actor={chosen.envs_per_actor} --set topology.fragment_length={chosen.fragment_length}"
        "   (or topology.learners/actors: auto in the config)"
    )
    if cfg.balance.lag_is_auto:
        settled = settled_bound(cal, chosen)
        print(f"balance.max_policy_lag: auto settles near {settled} on it: --set balance.lag_start={settled}")
    return 0


def _plan_cluster(args: argparse.Namespace, cfg, cores_per_node: int) -> int:
    from tianji.config import ConfigError
    from tianji.tools.calibration import calibrate
    from tianji.tools.plan import format_cluster, layout_space, predict_cluster

    if (
        (args.nodes is not None and args.nodes < 1)
        or cores_per_node < 1
        or args.link_gbit <= 0
        or args.link_latency_us < 0
        or (args.gpu_learner_rate is not None and args.gpu_learner_rate <= 0)
    ):
        raise ConfigError(
            "--nodes, --cores-per-node, --link-gbit and --gpu-learner-rate: expected positive numbers "
            "(--link-latency-us: zero or more)"
        )
    space = layout_space(cfg, cores_per_node, plan_envs=True, plan_actors=True, plan_learners=True)
    print(
        f"calibrating {args.config} on this machine: one learner, every core at once, a learner group of two, one "
        f"actor for each of {space.envs} envs",
        flush=True,
    )
    cal = calibrate(cfg, space, group=True)
    link_bytes, link_latency = args.link_gbit * 1e9 / 8, args.link_latency_us * 1e-6
    if args.cluster:
        return _plan_ray_cluster(cfg, cal, link_bytes, link_latency, args.gpu_learner_rate)
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < args.nodes} | {args.nodes})
    predictions = [
        predict_cluster(cal, cfg, n, cores_per_node, link_bytes, link_latency, args.gpu_learner_rate) for n in sizes
    ]
    print(format_cluster(cal, predictions, link_bytes, link_latency, cfg.sync.mode, args.gpu_learner_rate))
    return 0


def _plan_ray_cluster(cfg, cal, link_bytes: float, link_latency: float, gpu_learner_rate: float | None) -> int:
    from tianji.runtime.launchers.ray import measure_link, node_resources
    from tianji.runtime.launchers.ray_boot import boot
    from tianji.tools.plan import link_from_probe, plan_cluster

    booted = boot(cfg.ray.address or "auto")
    nodes = node_resources(booted.ray)
    costs = measure_link(booted.ray, cal.parameters) if len(nodes) > 1 else None
    if costs is not None:  # the link the learners' collectives will cross, measured as they will use it
        link_bytes, link_latency = link_from_probe(cal, costs)
        print(
            f"link measured between two nodes (a learner group of two over TCP): all_reduce of one number "
            f"{costs['allreduce_latency_s'] * 1e6:,.0f} us, {costs['allreduce_bytes_per_s'] / 1e6:,.1f} MB/s "
            "(used instead of --link-gbit/--link-latency-us)"
        )
    layouts, total, why = plan_cluster(cal, cfg, nodes, link_bytes, link_latency, gpu_learner_rate)
    for index, (node, layout) in enumerate(zip([n for n in nodes if n.get("CPU", 0) >= 2], layouts, strict=False)):
        print(
            f"node {index}: {node.get('CPU', 0):g} CPUs, {node.get('GPU', 0):g} GPUs -> {layout.learners} learner(s) x "
            f"{layout.actors} actors x {layout.envs_per_actor} envs ({layout.env_steps_per_s:,.0f} env steps/s, "
            f"max lag {layout.max_lag:g})"
        )
    print(why)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tianji.tools.evaluate import evaluate_run

    result = evaluate_run(
        Path(args.run_dir), args.episodes, Path(args.video) if args.video else None, view=args.video_view
    )
    print(
        f"{args.run_dir}: policy version {result['policy_version']}, {result['episodes']} greedy episodes: "
        f"mean {result['mean']:.2f} +- {result['std']:.2f}, min {result['min']:.2f}, max {result['max']:.2f} "
        f"(mean length {result['length_mean']:.0f})"
        + (f", win rate {result['win_rate']:.0%}" if "win_rate" in result else "")
    )
    if "video" in result:
        print(f"video of the first episode: {result['video']}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from tianji.tools.plot import plot_run, plot_runs

    run_dirs = [Path(d) for d in args.run_dirs]
    if len(run_dirs) == 1 and args.out is None:
        print(plot_run(run_dirs[0]))
    else:
        print(plot_runs(run_dirs, Path(args.out or "curves.png"), args.title))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from tianji.config import ConfigError, load_config

    try:
        from tianji.tools.sweep.report import format_table, trial_rows
        from tianji.tools.sweep.space import resolve_space
        from tianji.tools.sweep.study import Sweep, SweepSettings, create_sweep, load_settings, save_settings
    except ModuleNotFoundError as exc:
        if exc.name not in ("optuna", "matplotlib"):
            raise
        raise ConfigError(f"tianji sweep needs {exc.name}: pip install 'tianji[sweep]'") from None

    if args.resume:
        sweep_dir = Path(args.resume)
        settings = load_settings(sweep_dir)
        settings.trials = args.trials or settings.trials
        settings.max_minutes = args.max_minutes if args.max_minutes is not None else settings.max_minutes
        save_settings(sweep_dir, settings)
    else:
        if not args.config:
            raise ConfigError("sweep: give a preset name or a YAML path (or --resume SWEEP_DIR)")
        overrides = list(args.overrides)
        if args.trial_seconds is not None:
            overrides.append(f"stop.max_wall_time_s={args.trial_seconds}")
        if args.trial_env_steps is not None:
            overrides.append(f"stop.max_env_steps={args.trial_env_steps}")
        space = resolve_space(args.config, args.space, args.params)
        settings = SweepSettings(
            config=args.config,
            space={p.key: p.to_dict() for p in space},
            trials=args.trials or 20,
            overrides=overrides,
            objective=args.objective,
            max_minutes=args.max_minutes,
            seed=args.seed,
            sampler=args.sampler,
            pruner=args.pruner,
            report_every=args.report_every,
            grace_s=args.grace_s,
            silent_s=args.silent_s,
            parallel=args.parallel,
            launcher=args.launcher,
            address=args.address,
        )
        name = load_config(args.config, overrides).name
        sweep_dir = Path(args.sweep_dir or f"sweeps/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        create_sweep(settings, sweep_dir, plan_layout=args.trial_layout == "plan")
        print(
            f"sweep directory: {sweep_dir}\nobjective: {settings.objective} | space: "
            + ", ".join(f"{p.key} {p.describe()}" for p in space),
            flush=True,
        )
    sweep = Sweep(sweep_dir)
    outcome = sweep.run()
    print(format_table(trial_rows(sweep.study, sweep.params, sweep.objective)))
    best = sweep_dir / "best.yaml"
    print(f"best config: {best}  (tianji train {best})" if best.exists() else "no trial completed: no best.yaml")
    if outcome != "done":
        print(
            f"sweep {'interrupted' if outcome == 'interrupted' else 'out of time'}; continue it with "
            f"tianji sweep --resume {sweep_dir}"
        )
    return {"done": 0, "time": 3}.get(outcome, 130)  # scripts can tell a finished sweep from a stopped one


def _compare(args: argparse.Namespace) -> int:
    from tianji.tools.replay import run_differences

    first, second = (Path(run) for run in args.run_dirs)
    differences = run_differences(first, second)
    for line in differences:
        print(line)
    print(f"{first} and {second}: {'differ' if differences else 'the same run'}")
    return 1 if differences else 0


def _resolve_config(args: argparse.Namespace):
    from tianji.config import ConfigError, apply_overrides, build_config, load_config

    if args.address is not None:
        args.overrides.append(f"ray.address={args.address}")
    if args.resume:
        from tianji.tools.train import load_run_config

        saved = load_run_config(Path(args.resume)).model_dump(mode="json")
        return build_config(apply_overrides(saved, args.overrides))
    if not args.config:
        raise ConfigError("train: give a preset name or a YAML path (or --resume RUN_DIR)")
    return load_config(args.config, args.overrides)


def _train(args: argparse.Namespace) -> int:
    from tianji.tools.train import train

    cfg = _resolve_config(args)
    run_dir, summary = train(cfg, args.launcher, args.run_dir, args.resume, t0=T0)
    _print_summary(run_dir, summary)
    return 0


def _print_summary(run_dir: Path, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="TianJi run summary", show_header=False)
    for key in (
        "stop_reason",
        "target_reached",
        "time_to_target_s",
        "env_steps_to_target",
        "final_return_mean100",
        "env_steps",
        "wall_time_s",
        "policy_lag_mean",
        "policy_lag_max",
        "fragments_dropped",
    ):
        value = summary.get(key)
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    print(f"run directory: {run_dir}", flush=True)  # never wrapped: scripts and people copy it whole


def _raise_interrupt(signum, frame):  # SIGTERM stops a run the way Ctrl-C does
    raise KeyboardInterrupt


def _boot_ray_if_asked(argv: list[str]) -> None:
    """`train --launcher ray`: start this machine's zygote (it loads the role code at once), then join
    or start Ray with a warm host that will drive that zygote, then load the rest here: the three
    overlap instead of adding up. The launcher checks that the address it finally reads from the
    config is the one booted."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--launcher")
    pre.add_argument("--address")
    pre.add_argument("--set", dest="overrides", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    if known.command != "train" or known.launcher != "ray" or {"-h", "--help"} & set(argv):
        return
    set_address = [o.split("=", 1)[1] for o in known.overrides if o.startswith("ray.address=")]
    boot_early(known.address or (set_address[-1] if set_address else None))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    _boot_ray_if_asked(argv)
    from tianji.config import ConfigError, preset_names
    from tianji.runtime.shared.checkpoint import CheckpointError

    args = _parser().parse_args(argv)
    if args.command == "presets":
        for name in preset_names():
            print(name)
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.command == "eval":
            return _eval(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "compare":
            return _compare(args)
        return _plan(args) if args.command == "plan" else _train(args)
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a role failed beyond repair (RoleError); the log above has its traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
