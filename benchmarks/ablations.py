"""The paper's ablation table on CartPole: what balance, queue depth, layout and actor count do to
time-to-target, env steps to target, throughput and policy lag.

    python benchmarks/ablations.py [--seeds 3] [--algos ppo dqn] [--out ablations.png]

Every variant is run as a fresh `tianji train` command per seed, one after another, and reported
as the median over seeds (a seed that misses the target within the cap counts as the cap). The
table is printed and saved beside the plot as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import run_tianji

CAP_S = {"ppo": 60, "dqn": 60}
PRESET = {"ppo": "cartpole-ppo", "dqn": "cartpole-dqn"}
NO_BOUND = 1_000_000


def variants(algo: str, seed_for_random: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) for one algorithm; the preset itself is 'balance on'."""
    rng = random.Random(seed_for_random)
    random_layout = [f"topology.actors={rng.choice([1, 2, 3, 4])}",
                     f"topology.envs_per_actor={rng.choice([4, 8, 16, 64])}"]
    if algo == "ppo":
        steps = 32 * 64
        random_layout.append(f"topology.fragment_length={steps // int(random_layout[1].split('=')[1])}")
        rows = [
            ("balance on (preset)", []),
            ("balance off (no back-pressure, no lag bound)",
             ["balance.backpressure=false", f"balance.max_policy_lag={NO_BOUND}"]),
            ("more old samples (16 in flight per actor, no lag bound)",
             ["balance.max_inflight=16", f"balance.max_policy_lag={NO_BOUND}"]),
            # envs auto keeps 16 x fragment_length env steps per fragment: 16 x 128 = the preset's 32 x 64
            ("planned layout (actors, envs: auto)",
             ["topology.actors=auto", "topology.envs_per_actor=auto", "topology.fragment_length=128"]),
            (f"random layout ({random_layout[0].split('=')[1]} actors x {random_layout[1].split('=')[1]} envs)",
             random_layout),
        ]
    else:
        rows = [
            ("balance on (preset: replay-ratio limiter)", []),
            ("balance off (no rate limiter)", ["balance.replay_ratio=null", "balance.backpressure=false"]),
            ("planned layout (actors: auto)", ["topology.actors=auto"]),
        ]
    rows += [(f"{a} actor{'s' if a > 1 else ''} per learner", [f"topology.actors={a}"]) for a in (1, 2, 4, 8)]
    return rows


def run_once(algo: str, overrides: list[str], seed: int, root: Path) -> dict:
    run_dir = root / f"run-{time.monotonic_ns()}"
    summary = run_tianji(PRESET[algo], run_dir, seed, [f"stop.max_wall_time_s={CAP_S[algo]}", *overrides])
    summary["layout"] = _layout((run_dir / "config.yaml").read_text())
    return summary


def _layout(config_yaml: str) -> str:
    import yaml

    t = yaml.safe_load(config_yaml)["topology"]
    return f"{t['actors']}x{t['envs_per_actor']}"


def summarize(name: str, runs: list[dict], cap: float) -> dict:
    times = [r["time_to_target_s"] if r["target_reached"] else cap for r in runs]
    steps = [r["env_steps_to_target"] for r in runs if r["target_reached"]]
    return {
        "variant": name,
        "reached": f"{sum(r['target_reached'] for r in runs)}/{len(runs)}",
        "time_to_target_s": statistics.median(times),
        "env_steps_to_target": statistics.median(steps) if steps else None,
        "env_steps_per_s": statistics.median(r["env_steps"] / r["wall_time_s"] for r in runs),
        "lag_mean": statistics.median(r["policy_lag_mean"] for r in runs),
        "lag_max": max(r["policy_lag_max"] for r in runs),
        "layouts": sorted({r["layout"] for r in runs}),
    }


def print_table(algo: str, rows: list[dict]) -> None:
    print(f"\n{PRESET[algo]} (median over seeds; misses count as the {CAP_S[algo]} s cap)")
    print(f"{'variant':<58} {'reached':>7} {'time s':>7} {'steps':>9} {'steps/s':>9} {'lag avg':>7} "
          f"{'lag max':>8}  layout")
    for r in rows:
        steps = "-" if r["env_steps_to_target"] is None else f"{r['env_steps_to_target']:,.0f}"
        print(f"{r['variant']:<58} {r['reached']:>7} {r['time_to_target_s']:>7.1f} {steps:>9} "
              f"{r['env_steps_per_s']:>9,.0f} {r['lag_mean']:>7.1f} {r['lag_max']:>8}  {','.join(r['layouts'])}")


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
    parser.add_argument("--algos", nargs="+", default=["ppo", "dqn"], choices=["ppo", "dqn"])
    parser.add_argument("--out", default="ablations.png", help="plot path (a .json with the table goes beside it)")
    args = parser.parse_args()
    started = time.time()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            rows = []
            for name, overrides in variants(algo, seed_for_random=12345):
                if "topology.actors=auto" in overrides:  # calibrate once, outside the timed runs (then cached)
                    run_once(algo, overrides + ["stop.max_env_steps=1"], 0, Path(tmp))
                runs = [run_once(algo, overrides, seed, Path(tmp)) for seed in range(args.seeds)]
                rows.append(summarize(name, runs, CAP_S[algo]))
                print(f"  done: {algo} / {name} ({time.time() - started:.0f} s)", flush=True)
            results[algo] = rows
    for algo, rows in results.items():
        print_table(algo, rows)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out)
    print(f"\nplot: {out}   table: {out.with_suffix('.json')}   total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
