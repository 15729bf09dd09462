"""Scaling evidence: the planner's model checked against real runs on this machine, then its
predictions for clusters of machines like this one.

    python benchmarks/scaling.py [--presets cartpole-ppo pong-ppo] [--seconds 12] [--repeats 3] [--nodes 16]
                                 [--cores-per-node 40] [--link-gbit 10] [--out benchmarks/results]

For each preset:
1. calibrate as the planner does (one actor per envs-per-actor value, one learner, a learner group
   of two on this machine: `tianji.tools.plan`);
2. run every layout that fits this machine (learners x actors: 1 x 1, 1 x 2, 2 x 2) for --seconds as
   an ordinary `tianji train` and measure its env steps/s over the steady part (metrics.csv from its
   second row to its next-to-last), the learners' busy fraction and the largest policy lag; each
   layout --repeats times, in turn (1x1, 1x2, 2x2, 1x1, ...), the median counts (runs on a shared
   2-core machine vary by 10-25 % from one to the next);
3. put the model's prediction for the same layout next to it, with the error;
   with --two-nodes also on a two-node Ray test cluster on this machine (learner and actors on
   different nodes, fragments over TCP; Ray must be installed);
4. predict 1, 2, 4, ... --nodes machines of --cores-per-node cores joined by --link-gbit, with CPU
   learners as the planner lays them out and with one GPU learner per node that keeps up (no GPU
   here: its rate is not measured; the planner takes a measured one with --gpu-learner-rate).
Writes scaling.json, scaling.md and scaling.png (matplotlib) into --out. Measured numbers come from
runs here; everything for more than this machine is predicted.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from tianji.config import load_config
from tianji.runtime.launchers.ray_boot import loopback_only
from tianji.tools import calibration, plan

from common import train_command

LAYOUTS = ((1, 1), (1, 2), (2, 2))  # (learners, actors) that fit 2 cores
# predicted clusters: CPU learners as the planner lays them out, or one GPU learner per node
CLUSTER_KINDS = (("cpu", "allreduce"), ("cpu", "average"), ("gpu", "allreduce"), ("gpu", "average"))
GPU_KEEPS_UP = 1e9  # env steps/s of a GPU learner that is never the bottleneck (no GPU here to measure one)


def cfg_with_sync(cfg, mode: str):
    return cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"mode": mode})})


def measure(
    preset: str, learners: int, actors: int, seconds: float, run_dir: Path, *settings: str, launcher: str | None = None
) -> dict:
    """A real run of this layout, no target: steady env steps/s, learner busy fraction, policy lag."""
    layout = [f"topology.learners={learners}", f"topology.actors={actors}"]
    stop = ["stop.target_return=null", f"stop.max_wall_time_s={seconds}", "logging.interval_s=1"]
    command = train_command(preset, run_dir, *layout, *stop, *settings, launcher=launcher)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    steady = rows[1:-1] if len(rows) > 3 else rows
    first, last = steady[0], steady[-1]
    rate = (float(last["env_steps"]) - float(first["env_steps"])) / (float(last["time_s"]) - float(first["time_s"]))
    busy = [float(r["perf/learner_busy"]) for r in steady if r.get("perf/learner_busy") not in ("", "nan", None)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "env_steps_per_s": rate,
        "learner_busy": sum(busy) / max(1, len(busy)),
        "policy_lag_max": summary["policy_lag_max"],
        "policy_lag_mean": summary["policy_lag_mean"],
    }


def measure_two_nodes(preset: str, seconds: float, repeats: int, tmp: Path) -> list[dict]:
    """The 1 learner x 2 actors layout on a two-node Ray test cluster made on this machine: the learner
    on the head node, the actors on the worker node, every fragment over TCP (the same 2 cores)."""
    import ray
    from ray.cluster_utils import Cluster

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
    cluster.add_node(num_cpus=2, resources={"worker_node": 2}, node_ip_address="127.0.0.1")
    try:
        return [
            measure(
                preset,
                1,
                2,
                seconds,
                tmp / f"{preset}-two-nodes-{repeat}",
                f"ray.address={cluster.address}",
                "ray.learner_resources={head_node: 1}",
                "ray.actor_resources={worker_node: 1}",
                launcher="ray",
            )
            for repeat in range(repeats)
        ]
    finally:
        cluster.shutdown()


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's throughput beside it."""
    ranked = sorted(runs, key=lambda run: run["env_steps_per_s"])
    return {**ranked[len(ranked) // 2], "runs_env_steps_per_s": [run["env_steps_per_s"] for run in runs]}


def predicted(cal: calibration.Calibration, cfg, learners: int, actors: int, cores: int) -> dict:
    envs = cfg.topology.envs_per_actor
    space = calibration.Space(
        envs=[envs], actors=[actors], fragment_steps=cal.fragment_steps, preferred_envs=envs, learners=(learners,)
    )
    layout = next(c for c in plan.predict(cal, cfg, space, cores) if (c.learners, c.actors) == (learners, actors))
    return {
        "env_steps_per_s": layout.env_steps_per_s,
        "learner_busy": layout.learner_utilization,
        "policy_lag_max": layout.max_lag,
    }


def calibrated(preset: str, cores_per_node: int) -> tuple[object, calibration.Calibration]:
    """The planner's calibration, in a fresh interpreter as `tianji plan` does it: a process that has
    already stepped another preset's envs (ALE's above all) trains 15-25 % slower."""
    cfg = load_config(preset, [])
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        raw = json.loads(fresh.submit(_calibrate, preset, cores_per_node).result())
    raw["actor_rates"] = {int(k): v for k, v in raw["actor_rates"].items()}
    return cfg, calibration.Calibration(**raw)


def _calibrate(preset: str, cores_per_node: int) -> str:
    cfg = load_config(preset, [])
    space = plan.layout_space(cfg, cores_per_node, plan_envs=True, plan_actors=True, plan_learners=True)
    space = replace(space, envs=sorted({*space.envs, cfg.topology.envs_per_actor}))
    return json.dumps(asdict(calibration.calibrate(cfg, space, group=True)))


def study(preset: str, args: argparse.Namespace, tmp: Path) -> dict:
    cores = calibration.available_cores()
    cfg, cal = calibrated(preset, args.cores_per_node)
    runs = {("one machine", *layout): [] for layout in LAYOUTS}
    for repeat in range(args.repeats):
        for learners, actors in LAYOUTS:
            runs["one machine", learners, actors].append(
                measure(preset, learners, actors, args.seconds, tmp / f"{preset}-{learners}x{actors}-{repeat}")
            )
    if args.two_nodes:
        runs["two nodes (TCP)", 1, 2] = measure_two_nodes(preset, args.seconds, args.repeats, tmp)
    rows = []
    for (where, learners, actors), measured in runs.items():
        got = median_run(measured)
        want = predicted(cal, cfg, learners, actors, cores)
        rows.append(
            {
                "where": where,
                "learners": learners,
                "actors": actors,
                "measured": got,
                "predicted": want,
                "error": want["env_steps_per_s"] / got["env_steps_per_s"] - 1,
            }
        )
        print(
            f"{preset} {learners} x {actors} ({where}): measured {got['env_steps_per_s']:,.0f} env steps/s, predicted "
            f"{want['env_steps_per_s']:,.0f} ({rows[-1]['error']:+.0%})",
            flush=True,
        )
    link_bytes, link_latency = args.link_gbit * 1e9 / 8, args.link_latency_us * 1e-6
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= args.nodes]
    cluster = {
        f"{kind} {mode}": [
            asdict(
                plan.predict_cluster(
                    cal,
                    cfg_with_sync(cfg, mode),
                    n,
                    args.cores_per_node,
                    link_bytes,
                    link_latency,
                    GPU_KEEPS_UP if kind == "gpu" else None,
                )
            )
            for n in sizes
        ]
        for kind, mode in CLUSTER_KINDS
    }
    for mode, predictions in cluster.items():
        print(
            f"{preset} predicted, {mode}: "
            + ", ".join(f"{p['nodes']} nodes {p['env_steps_per_s']:,.0f}" for p in predictions),
            flush=True,
        )
    return {"preset": preset, "cores_here": cores, "calibration": asdict(cal), "layouts": rows, "cluster": cluster}


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    out = [
        f"# Scaling: measured here ({results[0]['cores_here']} cores) vs the planner's model, and predicted "
        f"clusters of {args.cores_per_node}-core nodes ({args.link_gbit:g} Gbit/s link)",
        "",
    ]
    out += [
        "## Measured vs predicted on this machine (env steps/s; learner busy; max policy lag)",
        "",
        "| preset | learners x actors | measured (median) | runs | predicted | error | learner busy meas./pred. "
        "| max lag meas./pred. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["layouts"]:
            m, p = row["measured"], row["predicted"]
            runs = ", ".join(f"{rate:,.0f}" for rate in m["runs_env_steps_per_s"])
            where = f"{row['learners']} x {row['actors']}" + (
                ", two nodes (TCP)" if row["where"] != "one machine" else ""
            )
            out.append(
                f"| {r['preset']} | {where} | {m['env_steps_per_s']:,.0f} | {runs} | "
                f"{p['env_steps_per_s']:,.0f} | {row['error']:+.0%} | {m['learner_busy']:.0%} / "
                f"{p['learner_busy']:.0%} | {m['policy_lag_max']} / {p['policy_lag_max']:.1f} |"
            )
    out += [
        "",
        "## Predicted (not measured): env steps/s for N nodes, every node running the chosen layout",
        "",
        "| preset | learners, sync | "
        + " | ".join(f"{p['nodes']} nodes" for p in results[0]["cluster"]["cpu allreduce"])
        + " | per node (learners x actors x envs) |",
        "|---|---|" + "---|" * (len(results[0]["cluster"]["cpu allreduce"]) + 1),
    ]
    for r in results:
        for mode, predictions in r["cluster"].items():
            layout = predictions[-1]["per_node"]
            out.append(
                f"| {r['preset']} | {mode} | "
                + " | ".join(f"{p['env_steps_per_s']:,.0f}" for p in predictions)
                + f" | {layout['learners']} x {layout['actors']} x {layout['envs_per_actor']} |"
            )
    out += [
        "",
        "gpu: one learner per node on a GPU that is never the bottleneck (not measured: no GPU on this "
        "machine); a GPU's measured rate (`tianji plan PRESET --set learner.device=cuda` on a GPU machine) goes in "
        "`tianji plan PRESET --nodes N --gpu-learner-rate R`.",
    ]
    return "\n".join(out) + "\n"


def picture(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for mode, style in (
            ("cpu allreduce", "-o"),
            ("cpu average", "--s"),
            ("gpu allreduce", ":^"),
            ("gpu average", ":v"),
        ):
            predictions = r["cluster"][mode]
            ax.plot(
                [p["nodes"] for p in predictions],
                [p["env_steps_per_s"] for p in predictions],
                style,
                label=f"{r['preset']} {mode} (predicted)",
            )
        best = max(r["layouts"], key=lambda row: row["measured"]["env_steps_per_s"])
        here = (
            r["cores_here"] / r["cluster"]["cpu allreduce"][0]["cores_per_node"]
        )  # this machine, as a fraction of a node
        ax.scatter(
            [here],
            [best["measured"]["env_steps_per_s"]],
            marker="*",
            s=140,
            zorder=5,
            label=f"{r['preset']} measured here ({r['cores_here']} cores)",
        )
        ax.scatter(
            [here],
            [best["predicted"]["env_steps_per_s"]],
            marker="o",
            facecolors="none",
            edgecolors="k",
            s=70,
            zorder=5,
            label=f"{r['preset']} predicted here",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("env steps/s")
    ax.set_title("TianJi throughput: measured on this machine, predicted for clusters")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["cartpole-ppo", "pong-ppo"])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each measured run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each layout (the median counts)")
    parser.add_argument(
        "--two-nodes",
        action="store_true",
        help="also 1 learner x 2 actors on a two-node Ray test "
        "cluster on this machine (learner on one node, actors on the other, fragments over TCP)",
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--cores-per-node", type=int, default=40, help="the paper's nodes have 40 cores")
    parser.add_argument("--link-gbit", type=float, default=10.0)
    parser.add_argument("--link-latency-us", type=float, default=50.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        results = [study(preset, args, Path(tmp)) for preset in args.presets]
    (out / "scaling.json").write_text(json.dumps(results, indent=2))
    (out / "scaling.md").write_text(markdown(results, args))
    picture(results, out / "scaling.png")
    print(markdown(results, args))


if __name__ == "__main__":
    main()
