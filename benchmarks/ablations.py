"""The paper's ablation table on CartPole: what balance, queue depth, layout, actor count and the
synchronisation of several learners do to time-to-target, env steps to target, throughput and lag.

    python benchmarks/ablations.py [--seeds 3] [--algos ppo dqn] [--rows planned actor] [--out ablations.png]

Every variant is run as a fresh `tianji train` command per seed, the variants taking turns seed by
seed (so slow drift of the machine hits every row alike), and reported as the median over seeds (a
seed that misses the target within the cap counts as the cap). The planned row trains with the layout
`tianji plan PRESET` chooses on this machine (its run time is printed). The table is printed and saved
beside the plot as JSON, with the planned row's time over the best hand layout's.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import run_tianji

CAP_S = {"ppo": 60, "dqn": 60}
PRESET = {"ppo": "cartpole-ppo", "dqn": "cartpole-dqn"}
NO_BOUND = 1_000_000
PLANNED = "planned layout (`tianji plan` choice)"


def variants(algo: str, seed_for_random: int, planned: list[str]) -> list[tuple[str, list[str]]]:
    """(name, overrides) for one algorithm; the preset itself is 'balance on'; `planned` is the
    layout `tianji plan` chose."""
    rng = random.Random(seed_for_random)
    random_layout = [
        f"topology.actors={rng.choice([1, 2, 3, 4])}",
        f"topology.envs_per_actor={rng.choice([4, 8, 16, 64])}",
    ]
    if algo == "ppo":
        steps = 32 * 64
        random_layout.append(f"topology.fragment_length={steps // int(random_layout[1].split('=')[1])}")
        rows = [
            ("balance on (preset)", []),
            (
                "balance off (no back-pressure, no lag bound)",
                ["balance.backpressure=false", f"balance.max_policy_lag={NO_BOUND}"],
            ),
            (
                "more old samples (16 in flight per actor, no lag bound)",
                ["balance.max_inflight=16", f"balance.max_policy_lag={NO_BOUND}"],
            ),
            (PLANNED, planned),
            (
                f"random layout ({random_layout[0].split('=')[1]} actors x {random_layout[1].split('=')[1]} envs)",
                random_layout,
            ),
        ]
    else:
        rows = [
            ("balance on (preset: replay-ratio limiter)", []),
            ("balance off (no rate limiter)", ["balance.replay_ratio=null", "balance.backpressure=false"]),
            (PLANNED, planned),
        ]
    rows += [(f"{a} actor{'s' if a > 1 else ''} per learner", [f"topology.actors={a}"]) for a in (1, 2, 4, 8)]
    # several learners (2 actors in all, one per learner): the strict and the relaxed synchronisation
    group = ["topology.learners=2", "topology.actors=2"]
    rows += [("2 learners, allreduce every step", [*group, "sync.mode=allreduce"])]
    rows += [
        (
            f"2 learners, average every {k} update{'s' if k > 1 else ''}",
            [*group, "sync.mode=average", f"sync.every={k}"],
        )
        for k in (1, 4, 16)
    ]
    rows += [
        (
            "2 learners, average every update, own Adam moments",
            [*group, "sync.mode=average", "sync.every=1", "sync.average_optimizer=false"],
        )
    ]
    return rows


def plan_layout(algo: str) -> tuple[list[str], float]:
    """The overrides `tianji plan PRESET` prints as its choice, and how long the command took."""
    started = time.time()
    output = subprocess.run(
        [sys.executable, "-m", "tianji", "plan", PRESET[algo]], check=True, capture_output=True, text=True
    ).stdout
    chosen = next(line for line in output.splitlines() if line.startswith("chosen:"))
    return re.findall(r"--set (\S+)", chosen), time.time() - started


def hand_layouts(table: list[tuple[str, list[str]]]) -> set[str]:
    """Rows that fix a layout by hand: the preset and rows that override only the topology."""
    return {
        name for name, overrides in table if name != PLANNED and all(item.startswith("topology.") for item in overrides)
    }


def planned_vs_best_hand(rows: list[dict], hand_names: set[str]) -> list[str]:
    """The planned row's time over the best hand row's, and over the best hand row with another
    layout (rows with the planned layout itself differ only by run-to-run noise)."""
    planned = next((r for r in rows if r["variant"] == PLANNED), None)
    if planned is None:
        return []
    hand = [r for r in rows if r["variant"] in hand_names]
    lines = []
    for label, pool in (
        ("best hand layout", hand),
        ("best other layout", [r for r in hand if r["layouts"] != planned["layouts"]]),
    ):
        if pool:
            best = min(pool, key=lambda r: r["time_to_target_s"])
            lines.append(
                f"planned layout / {label} ({best['variant']}, {','.join(best['layouts'])}): "
                f"{planned['time_to_target_s'] / best['time_to_target_s']:.2f}"
            )
    same = [r["time_to_target_s"] for r in [planned, *hand] if r["layouts"] == planned["layouts"]]
    lines.append(
        f"rows with the planned layout {','.join(planned['layouts'])}: "
        f"{min(same):.1f}-{max(same):.1f} s (run-to-run noise)"
    )
    return lines


def run_once(algo: str, overrides: list[str], seed: int, root: Path) -> dict:
    run_dir = root / f"run-{time.monotonic_ns()}"
    summary = run_tianji(PRESET[algo], run_dir, seed, [f"stop.max_wall_time_s={CAP_S[algo]}", *overrides])
    summary["layout"] = _layout((run_dir / "config.yaml").read_text())
    return summary


def _layout(config_yaml: str) -> str:
    import yaml

    t = yaml.safe_load(config_yaml)["topology"]
    return f"{t['actors']}x{t['envs_per_actor']}" + (f"/{t['learners']}L" if t.get("learners", 1) != 1 else "")


def summarize(name: str, runs: list[dict], cap: float) -> dict:
    times = [r["time_to_target_s"] if r["target_reached"] else cap for r in runs]
    steps = [r["env_steps_to_target"] for r in runs if r["target_reached"]]
    return {
        "variant": name,
        "reached": f"{sum(r['target_reached'] for r in runs)}/{len(runs)}",
        "time_to_target_s": statistics.median(times),
        "env_steps_to_target": statistics.median(steps) if steps else None,
        "env_steps_per_s": statistics.median(r["env_steps"] / r["wall_time_s"] for r in runs),
        "updates_per_s": statistics.median(r["updates"] / r["wall_time_s"] for r in runs),
        "lag_mean": statistics.median(r["policy_lag_mean"] for r in runs),
        "lag_max": max(r["policy_lag_max"] for r in runs),
        "layouts": sorted({r["layout"] for r in runs}),
    }


def print_table(algo: str, rows: list[dict]) -> None:
    print(f"\n{PRESET[algo]} (median over seeds; misses count as the {CAP_S[algo]} s cap)")
    print(
        f"{'variant':<58} {'reached':>7} {'time s':>7} {'steps':>9} {'steps/s':>9} {'upd/s':>7} {'lag avg':>7} "
        f"{'lag max':>8}  layout"
    )
    for r in rows:
        steps = "-" if r["env_steps_to_target"] is None else f"{r['env_steps_to_target']:,.0f}"
        print(
            f"{r['variant']:<58} {r['reached']:>7} {r['time_to_target_s']:>7.1f} {steps:>9} "
            f"{r['env_steps_per_s']:>9,.0f} {r.get('updates_per_s', float('nan')):>7.1f} {r['lag_mean']:>7.1f} "
            f"{r['lag_max']:>8}  {','.join(r['layouts'])}"
        )


def plot(results: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(14, 4.5 * len(results)), squeeze=False)
    for row, (algo, rows) in enumerate(results.items()):
        names = [r["variant"] for r in rows]
        axes[row][0].barh(names, [r["time_to_target_s"] for r in rows], color="tab:blue")
        axes[row][0].set_xlabel("median time to target (s, lower is better)")
        axes[row][0].set_title(f"{PRESET[algo]}: time to target")
        axes[row][0].invert_yaxis()
        axes[row][1].barh(names, [r["lag_mean"] for r in rows], color="tab:orange")
        axes[row][1].set_xlabel("median of mean policy lag (versions)")
        axes[row][1].set_xscale("symlog")
        axes[row][1].set_title(f"{PRESET[algo]}: policy lag")
        axes[row][1].invert_yaxis()
        axes[row][1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--algos", nargs="+", default=["ppo", "dqn"], choices=["ppo", "dqn"])
    parser.add_argument("--out", default="ablations.png", help="plot path (a .json with the table goes beside it)")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="only the variants whose name contains one of these (e.g. planned actor)",
    )
    args = parser.parse_args()
    started = time.time()
    results: dict[str, list[dict]] = {}
    hand: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            planned, plan_s = plan_layout(algo)
            print(f"  tianji plan {PRESET[algo]}: {' '.join(planned)} ({plan_s:.0f} s)", flush=True)
            table = variants(algo, seed_for_random=12345, planned=planned)
            if args.rows:
                table = [(name, o) for name, o in table if any(text in name for text in args.rows)]
            runs: dict[str, list[dict]] = {name: [] for name, _ in table}
            for seed in range(args.first_seed, args.first_seed + args.seeds):  # variants take turns, seed by seed
                for name, overrides in table:
                    runs[name].append(run_once(algo, overrides, seed, Path(tmp)))
                print(f"  done: {algo} seed {seed} ({time.time() - started:.0f} s)", flush=True)
            results[algo] = [summarize(name, runs[name], CAP_S[algo]) for name, _ in table]
            hand[algo] = hand_layouts(table)
    for algo, rows in results.items():
        print_table(algo, rows)
        print("\n".join(planned_vs_best_hand(rows, hand[algo])))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    try:
        plot(results, out)
    except ImportError:
        print(f"\nno plot: matplotlib is missing (pip install -e '.[bench]'); table: {out.with_suffix('.json')}")
        return
    print(f"\nplot: {out}   table: {out.with_suffix('.json')}   total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
