"""The paper's staleness ablation on Pong: every setting equal except the policy-lag bound.

    python benchmarks/pong_staleness.py [--preset pong-ppo] [--bounds 0 1 2 4 8] [--seeds 1] [--two-seeds 0 3]
                                        [--correction on off] [--max-env-steps 2500000] [--minutes 40]

Each run is one `tianji train PRESET --set balance.max_policy_lag=B` command (with
`algo.proximal` on or off: the stale-fragment correction), one after another, never two at once.
Enough fragments may be in flight to reach the bound (`balance.max_inflight`, and `--actors-for B:N`
gives a bound more actors). The table reports, per run, the lag measured, the env steps and the minutes
to a 100-episode mean of -15, 0, 12 and 18 (where reached within the budget), and how many env steps
each run needed relative to the synchronous one (bound 0) of the same correction and seed.
Runs already finished (their summary.json exists) are read, not run again, so the script can be
stopped and restarted; the table also shows every other finished run under --run-root, so invocations
with different bounds or corrections add up. Results: benchmarks/results/pong-staleness.{md,json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

from common import train_command

THRESHOLDS = (-15.0, 0.0, 12.0, 18.0)
RESULTS = Path(__file__).parent / "results"


def run_name(bound: int, correction: str, seed: int) -> str:
    return f"lag{bound}-{correction}-s{seed}"


def train(preset: str, run_dir: Path, bound: int, correction: str, seed: int, args: argparse.Namespace) -> None:
    actors = dict(args.actors_for).get(bound)
    settings = [
        f"seed={seed}",
        f"balance.max_policy_lag={bound}",
        f"balance.max_inflight={max(1, args.inflight)}",
        f"algo.proximal={'true' if correction == 'on' else 'false'}",
        "stop.target_return=18",
        f"stop.max_env_steps={args.max_env_steps}",
        f"stop.max_wall_time_s={args.minutes * 60}",
        "logging.interval_s=10",
        "checkpoint.interval_s=600",
    ]
    if actors is not None:
        settings.append(f"topology.actors={actors}")
    command = train_command(preset, run_dir, *settings, *args.overrides)
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)


def curve(run_dir: Path) -> list[tuple[float, int, float]]:
    """(seconds, env steps, 100-episode mean) of every metrics row with a score."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [
            (float(r["time_s"]), int(float(r["env_steps"])), float(r["env/return_mean100"]))
            for r in csv.DictReader(f)
            if r["env/return_mean100"] not in ("", "nan")
        ]


def first_reaching(points: list[tuple[float, int, float]], threshold: float) -> tuple[float, int] | None:
    return next(((t, steps) for t, steps, score in points if score >= threshold), None)


def describe(run_dir: Path, bound: int, correction: str, seed: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    points = curve(run_dir)
    reached = {str(int(x)): first_reaching(points, x) for x in THRESHOLDS}
    return {
        "run": run_dir.name,
        "bound": bound,
        "correction": correction,
        "seed": seed,
        "lag_mean": summary.get("policy_lag_mean"),
        "lag_max": summary.get("policy_lag_max"),
        "fragments_dropped": summary.get("fragments_dropped"),
        "env_steps": summary.get("env_steps"),
        "wall_time_s": summary.get("wall_time_s"),
        "env_steps_per_s": summary["env_steps"] / max(summary["wall_time_s"], 1e-9),
        "final_score": points[-1][2] if points else None,
        "reached": {k: (None if v is None else {"minutes": v[0] / 60, "env_steps": v[1]}) for k, v in reached.items()},
    }


def earlier_runs(run_root: Path, taken: set[str]) -> list[dict]:
    """Finished runs of earlier invocations (other bounds, seeds or corrections), so that the table grows
    across invocations instead of showing only the last one's runs."""
    rows = []
    for run_dir in sorted(run_root.glob("lag*-*-s*")):
        if run_dir.name in taken or not (run_dir / "summary.json").exists():
            continue
        bound, correction, seed = run_dir.name.split("-")
        rows.append(describe(run_dir, int(bound[len("lag") :]), correction, int(seed[len("s") :])))
    return rows


def relative_to_synchronous(rows: list[dict]) -> None:
    """Each run's env steps to each threshold / the synchronous run's of the same seed (with no lag the
    correction changes nothing: one synchronous run serves both)."""
    sync = {r["seed"]: r for r in rows if r["bound"] == 0}
    for row in rows:
        base = sync.get(row["seed"])
        row["steps_vs_sync"] = {}
        for key, hit in row["reached"].items():
            if base is None or hit is None or base["reached"][key] is None:
                continue
            row["steps_vs_sync"][key] = hit["env_steps"] / base["reached"][key]["env_steps"]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    def cell(hit: dict | None) -> str:
        return "-" if hit is None else f"{hit['env_steps'] / 1e6:.2f}M / {hit['minutes']:.1f} min"

    lines = [
        f"# Pong: policy-lag bound ablation (`{args.preset}`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {_cores()} cores; {time.strftime('%Y-%m-%d')}. "
        f"Budget per run: {args.max_env_steps / 1e6:.1f}M env steps or {args.minutes:.0f} minutes. "
        "Every setting equal except the bound (and the correction); runs one at a time.",
        "",
        "| run | bound | correction | lag mean / max | dropped | env steps/s | -15 | 0 | 12 | 18 | final | "
        "env steps vs bound 0 (to -15 / 0 / 12 / 18) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["correction"], r["bound"], r["seed"])):
        ratios = " / ".join(
            f"{r['steps_vs_sync'][k]:.2f}" if k in r.get("steps_vs_sync", {}) else "-" for k in ("-15", "0", "12", "18")
        )
        lines.append(
            f"| {r['run']} | {r['bound']} | {r['correction']} | {r['lag_mean']:.1f} / {r['lag_max']} | "
            f"{r['fragments_dropped']} | {r['env_steps_per_s']:,.0f} | "
            + " | ".join(cell(r["reached"][k]) for k in ("-15", "0", "12", "18"))
            + f" | {r['final_score']:.1f} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def figure(rows: list[dict], run_root: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bounds = sorted({r["bound"] for r in rows})
    for r in rows:
        points = curve(run_root / r["run"])
        colour = colours[bounds.index(r["bound"]) % len(colours)]
        style = "-" if r["correction"] == "on" else ":"
        label = f"lag <= {r['bound']}, correction {r['correction']}, seed {r['seed']}"
        axes[0].plot([p[1] / 1e6 for p in points], [p[2] for p in points], style, color=colour, label=label)
        axes[1].plot([p[0] / 60 for p in points], [p[2] for p in points], style, color=colour, label=label)
    for ax, label in ((axes[0], "env steps (millions)"), (axes[1], "wall time (minutes)")):
        ax.set_xlabel(label)
        ax.set_ylabel("100-episode mean game score")
        ax.grid(alpha=0.3)
        for threshold in THRESHOLDS:
            ax.axhline(threshold, color="grey", linewidth=0.5)
    axes[0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-ppo")
    parser.add_argument("--bounds", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, default=1, help="seeds per bound")
    parser.add_argument("--two-seeds", type=int, nargs="*", default=[0], help="bounds run with 2 seeds")
    parser.add_argument("--correction", nargs="+", choices=["on", "off"], default=["on"])
    parser.add_argument("--inflight", type=int, default=4, help="balance.max_inflight of every run")
    parser.add_argument(
        "--actors-for",
        type=lambda s: tuple(int(x) for x in s.split(":")),
        nargs="*",
        default=[],
        metavar="BOUND:ACTORS",
        help="topology.actors for a bound (to reach it)",
    )
    parser.add_argument("--max-env-steps", type=int, default=2_500_000)
    parser.add_argument("--minutes", type=float, default=40.0)
    parser.add_argument("--run-root", default="runs/pong-staleness")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=str(RESULTS / "pong-staleness"))
    args = parser.parse_args()
    run_root = Path(args.run_root)
    run_root.mkdir(parents=True, exist_ok=True)
    rows = []
    for correction in args.correction:
        for bound in args.bounds:
            if bound == 0 and correction != args.correction[0]:
                continue  # synchronous: the correction is PPO exactly, the first run serves both
            for seed in range(args.seeds + (1 if bound in args.two_seeds and args.seeds < 2 else 0)):
                run_dir = run_root / run_name(bound, correction, seed)
                if not (run_dir / "summary.json").exists():
                    print(f"{run_dir.name}: training ...", flush=True)
                    if run_dir.exists():
                        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                    train(args.preset, run_dir, bound, correction, seed, args)
                rows.append(describe(run_dir, bound, correction, seed))
                print(f"{run_dir.name}: {rows[-1]['reached']}", flush=True)
    rows += earlier_runs(run_root, {r["run"] for r in rows})
    relative_to_synchronous(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"preset": args.preset, "runs": rows}, indent=2))
    out.with_suffix(".md").write_text(table(rows, args))
    figure(rows, run_root, out.with_suffix(".png"))
    print(table(rows, args))
    medians = {}
    for r in rows:
        for key, ratio in r.get("steps_vs_sync", {}).items():
            medians.setdefault((r["correction"], r["bound"], key), []).append(ratio)
    for (correction, bound, key), ratios in sorted(medians.items()):
        print(
            f"correction {correction} bound {bound}: env steps to {key} vs synchronous {statistics.median(ratios):.2f}"
        )


if __name__ == "__main__":
    main()
