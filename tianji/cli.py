"""Command line: `tianji train`, `tianji presets`. Imports of the rest of TianJi wait inside the
functions, so `train --launcher ray` can start Ray before torch loads (see `_boot_ray_if_asked`)."""

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

    train = sub.add_parser("train", help="train an agent", epilog=_config_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", nargs="?", help="preset name (see `tianji presets`) or path to a YAML config")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="override one config field, e.g. --set topology.actors=2 (repeatable)")
    train.add_argument("--run-dir", help="run directory (default: <logging.run_root>/<name>-<timestamp>)")
    train.add_argument("--launcher", choices=["local", "inline", "ray"], default="local",
                       help="local: one process per role on this machine (default); inline: all roles in this "
                       "process; ray: roles as Ray actors on a cluster (pip install 'tianji[ray]')")
    train.add_argument("--address", help="with --launcher ray: the Ray cluster to join ('auto' or HOST:PORT; "
                       "sets ray.address)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")

    plan = sub.add_parser("plan", help="measure actor and learner rates and choose a layout (actors, envs per actor)")
    plan.add_argument("config", help="preset name or path to a YAML config")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                      help="override one config field (repeatable)")
    plan.add_argument("--cores", type=int, default=None, help="plan for a machine with this many cores "
                      "(default: the cores available here)")
    plan.add_argument("--nodes", type=int, default=None, help="what-if: predict clusters of 1, 2, 4, ... up to this "
                      "many machines like this one (rates measured here), learners in one group across them")
    plan.add_argument("--cores-per-node", type=int, default=None, help="what-if: cores of each machine "
                      "(default: --cores, or the cores here)")
    plan.add_argument("--cluster", action="store_true", help="lay out the whole Ray cluster (ray.address, or the "
                      "one `ray start` made here): every node's CPUs, the rates measured on this machine")
    plan.add_argument("--link-gbit", type=float, default=10.0, help="what-if: network between machines, Gbit/s")
    plan.add_argument("--link-latency-us", type=float, default=50.0, help="what-if: one message's latency between "
                      "machines, microseconds")

    plot = sub.add_parser("plot", help="learning curves: one run into RUN_DIR/curve.png, several runs overlaid in "
                          "one picture (needs matplotlib)")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    plot.add_argument("--out", help="where the picture of several runs goes (default: curves.png here)")
    plot.add_argument("--title", help="title of the picture of several runs")

    evaluate = sub.add_parser("eval", help="play greedy episodes with a run's last checkpoint; print the score")
    evaluate.add_argument("run_dir", help="a run directory")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes to play (default 10)")
    evaluate.add_argument("--video", metavar="FILE", help="record the first episode as .mp4 or .gif")

    sub.add_parser("presets", help="list the bundled presets")
    return parser


def _plan(args: argparse.Namespace) -> int:
    from tianji.config import ConfigError, load_config
    from tianji.tools.plan import (
        available_cores,
        calibrate,
        choose,
        explain,
        format_table,
        lag_warning,
        layout_space,
        mark,
        predict,
    )

    cfg = load_config(args.config, args.overrides)
    cores = args.cores or available_cores()
    if cores < 1:
        raise ConfigError("--cores: expected a positive number of cores")
    if args.nodes is not None or args.cluster:
        return _plan_cluster(args, cfg, args.cores_per_node or cores)
    space = layout_space(cfg, cores, plan_envs=True, plan_actors=True, plan_learners=True)
    print(f"calibrating {args.config} on this machine: one actor for each of {space.envs} envs, then one learner",
          flush=True)
    cal = calibrate(cfg, space)
    layouts = predict(cal, cfg, space, cores)
    chosen = choose(layouts, space.preferred_envs, cores)
    print(format_table(cal, mark(layouts, chosen), cores))
    print(explain(cal, chosen, cores, cfg.sync.mode))
    configured = [c for c in layouts if (c.learners, c.actors, c.envs_per_actor)
                  == (cfg.topology.learners, cfg.topology.actors, cfg.topology.envs_per_actor)]
    same = (chosen.learners, chosen.actors, chosen.envs_per_actor)
    others = [c for c in configured if (c.learners, c.actors, c.envs_per_actor) != same]
    for layout, which in ((chosen, "chosen"), *((c, "configured") for c in others)):
        warning = lag_warning(cal, cfg, layout)
        if warning:
            print(f"{warning} ({which} layout)")
    print(f"chosen: --set topology.learners={chosen.learners} --set topology.actors={chosen.actors} "
          f"--set topology.envs_per_actor={chosen.envs_per_actor} --set topology.fragment_length={chosen.fragment_length}"
          "   (or topology.learners/actors: auto in the config)")
    return 0


def _plan_cluster(args: argparse.Namespace, cfg, cores_per_node: int) -> int:
    from tianji.config import ConfigError
    from tianji.tools.plan import calibrate, format_cluster, layout_space, predict_cluster

    if (args.nodes or 1) < 1 or cores_per_node < 1 or args.link_gbit <= 0 or args.link_latency_us < 0:
        raise ConfigError("--nodes, --cores-per-node and --link-gbit: expected positive numbers "
                          "(--link-latency-us: zero or more)")
    space = layout_space(cfg, cores_per_node, plan_envs=True, plan_actors=True, plan_learners=True)
    print(f"calibrating {args.config} on this machine: one actor for each of {space.envs} envs, one learner, "
          "a learner group of two", flush=True)
    cal = calibrate(cfg, space, group=True)
    link_bytes, link_latency = args.link_gbit * 1e9 / 8, args.link_latency_us * 1e-6
    if args.cluster:
        return _plan_ray_cluster(cfg, cal, link_bytes, link_latency)
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < args.nodes} | {args.nodes})
    predictions = [predict_cluster(cal, cfg, n, cores_per_node, link_bytes, link_latency) for n in sizes]
    print(format_cluster(cal, predictions, link_bytes, link_latency, cfg.sync.mode))
    return 0


def _plan_ray_cluster(cfg, cal, link_bytes: float, link_latency: float) -> int:
    from tianji.runtime.launchers.ray import node_resources
    from tianji.runtime.launchers.ray_boot import boot
    from tianji.tools.plan import plan_cluster

    booted = boot(cfg.ray.address or "auto")
    nodes = node_resources(booted.ray)
    layouts, total, why = plan_cluster(cal, cfg, nodes, link_bytes, link_latency)
    for index, (node, layout) in enumerate(zip([n for n in nodes if n.get("CPU", 0) >= 2], layouts)):
        print(f"node {index}: {node.get('CPU', 0):g} CPUs, {node.get('GPU', 0):g} GPUs -> {layout.learners} learner(s) x "
              f"{layout.actors} actors x {layout.envs_per_actor} envs ({layout.env_steps_per_s:,.0f} env steps/s)")
    print(why)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tianji.tools.evaluate import evaluate_run

    result = evaluate_run(Path(args.run_dir), args.episodes, Path(args.video) if args.video else None)
    print(f"{args.run_dir}: policy version {result['policy_version']}, {result['episodes']} greedy episodes: "
          f"mean {result['mean']:.2f} +- {result['std']:.2f}, min {result['min']:.2f}, max {result['max']:.2f} "
          f"(mean length {result['length_mean']:.0f})"
          + (f", win rate {result['win_rate']:.0%}" if "win_rate" in result else ""))
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
    for key in ("stop_reason", "target_reached", "time_to_target_s", "env_steps_to_target", "final_return_mean100",
                "env_steps", "wall_time_s", "policy_lag_mean", "policy_lag_max", "fragments_dropped"):
        value = summary.get(key)
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    console.print(f"run directory: {run_dir}")


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
    from tianji.runtime.driver.checkpoint import CheckpointError

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
        return _plan(args) if args.command == "plan" else _train(args)
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a role failed beyond repair (RoleError); the log above has its traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
