"""Every preset to its target, several seeds each: the table rl-baselines3-zoo users look for.

    python benchmarks/zoo.py [PRESET ...] [--seeds 3] [--max-minutes M] [--set key=value ...]
                             [--keep-runs DIR] [--replace]

Every preset with a target (atari-appo has none: benchmarks/atari.py measures it game by game; the SMAX maps'
presets run up to an hour each: benchmarks/smax.py --maps). Each run
is `tianji train PRESET --set seed=S` as a fresh command, timed from the command's start
(imports, process start-up and JIT compiles included), until the preset's own target or its own
time limit (or --max-minutes, whichever is shorter). Results are merged by preset into
benchmarks/results/zoo.json (so Pong can be measured in a separate, longer sitting) and the whole
table is written to benchmarks/results/zoo.md:

    preset | target | seeds reaching it | median time to target | median env steps | env steps/s | machine

Medians are over the seeds that reached the target; env steps/s is the median over all seeds of
env steps / wall time. Each seed's line also names the lowest policy entropy and the largest
one-update KL its run logged: a seed that reached the target after nearly collapsing (entropy near 0,
a KL far above the clip's) warns that others will not. Run one benchmark at a time on a machine: they
compete for the cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path

from tianji.config import load_config, preset_names

from common import machine, metric_rows, run_tianji, update_page_tables
from smax import MAP_PRESETS  # measured by benchmarks/smax.py --maps, against published win rates

RESULTS = Path(__file__).parent / "results"


def describe_target(preset: str) -> str:
    stop = load_config(preset).stop
    metric = {"train": "mean100", "eval": "greedy eval", "eval_win_rate": "greedy win rate"}[stop.target_metric]
    return f"{metric} >= {stop.target_return:g}" + (
        f" in {stop.max_wall_time_s / 60:g} min" if stop.max_wall_time_s else ""
    )


def summarize(preset: str, runs: list[dict]) -> dict:
    reached = [r for r in runs if r["target_reached"]]

    def median(key: str) -> float | None:
        return statistics.median(r[key] for r in reached) if reached else None

    return {
        "preset": preset,
        "target": describe_target(preset),
        "seeds": len(runs),
        "reached": len(reached),
        "median_time_to_target_s": median("time_to_target_s"),
        "median_env_steps_to_target": median("env_steps_to_target"),
        "env_steps_per_s": statistics.median(r["env_steps"] / r["wall_time_s"] for r in runs),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "runs": [
            {
                key: r.get(key)
                for key in (
                    "seed",
                    "target_reached",
                    "time_to_target_s",
                    "env_steps_to_target",
                    "return_at_target",
                    "final_return_mean100",
                    "final_eval_return_mean",
                    "final_eval_win_rate",
                    "env_steps",
                    "wall_time_s",
                    "stop_reason",
                )
            }
            for r in runs
        ],
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| preset | target | seeds reaching it | median time to target | median env steps | env steps/s | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        times = ", ".join(f"{r['time_to_target_s']:.0f}" if r["target_reached"] else "-" for r in row["runs"])
        time = f"{row['median_time_to_target_s']:.0f} s ({times})" if row["reached"] else f"- ({times})"
        steps = f"{row['median_env_steps_to_target'] / 1e6:.2f}M" if row["reached"] else "-"
        lines.append(
            f"| `{row['preset']}` | {row['target']} | {row['reached']}/{row['seeds']} | {time} | {steps} | "
            f"{row['env_steps_per_s']:,.0f} | {row['machine']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help="presets to run (default: those with a target, but the SMAX maps')")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=None, help="cap every run's wall time")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="an override for every run")
    parser.add_argument("--keep-runs", help="keep the run directories here (default: a temporary folder)")
    parser.add_argument("--out", default=str(RESULTS / "zoo"), help="results path without suffix")
    parser.add_argument("--replace", action="store_true", help="drop earlier results of presets not run now")
    parser.add_argument(
        "--from-runs",
        nargs="+",
        default=[],
        metavar="PRESET=RUN_DIR[,RUN_DIR]",
        help="take the rows of these presets from finished runs (each checked to be the preset's own "
        "config but for its seed) instead of training them again",
    )
    args = parser.parse_args()
    if args.from_runs:
        presets_from_runs(args)
        return
    presets = args.presets or [
        name for name in preset_names() if load_config(name).stop.target_return is not None and name not in MAP_PRESETS
    ]
    untargeted = [name for name in presets if load_config(name).stop.target_return is None]
    if untargeted:  # e.g. atari-appo: a score per game, measured by benchmarks/atari.py
        parser.error(f"{', '.join(untargeted)}: no stop.target_return to train to (Atari: benchmarks/atari.py)")
    out = Path(args.out)
    saved = (
        {}
        if args.replace or not out.with_suffix(".json").exists()
        else {row["preset"]: row for row in json.loads(out.with_suffix(".json").read_text())}
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep_runs or tmp)
        for preset in presets:
            runs = []
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                overrides = list(args.overrides)
                if args.max_minutes is not None:
                    limit = load_config(preset).stop.max_wall_time_s or float("inf")
                    overrides.append(f"stop.max_wall_time_s={min(limit, args.max_minutes * 60)}")
                summary = run_tianji(preset, root / f"{preset}-seed{seed}", seed, overrides)
                runs.append({**summary, "seed": seed})
                reached = f"{summary['time_to_target_s']:.0f} s" if summary["target_reached"] else "not reached"
                health = stability(root / f"{preset}-seed{seed}")
                print(f"{preset} seed {seed}: {reached}, {summary['env_steps']:,} env steps{health}", flush=True)
            saved[preset] = summarize(preset, runs)
            rows = [saved[name] for name in sorted(saved)]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
            out.with_suffix(".md").write_text(markdown(rows))
    print(markdown([saved[name] for name in sorted(saved)]))
    if out == RESULTS / "zoo":  # the project's own table, not a scratch one
        update_page_tables("zoo table", markdown([saved[name] for name in sorted(saved)]))


def stability(run_dir: Path) -> str:
    """The lowest policy entropy and the largest one-update approx KL among the run's logged rows
    (each row holds its interval's last update), or nothing for algorithms that log neither."""
    rows = metric_rows(run_dir)
    entropies = [row["train/entropy"] for row in rows if "train/entropy" in row]
    kls = [row["train/approx_kl"] for row in rows if "train/approx_kl" in row]
    parts = ([f"lowest entropy {min(entropies):.3f}"] if entropies else []) + (
        [f"largest update KL {max(kls):.3f}"] if kls else []
    )
    return f" ({', '.join(parts)})" if parts else ""


IGNORED = {"seed", "name", "logging", "checkpoint"}  # what may differ between a preset and a run of it


def preset_config_of(run_dir: Path) -> dict:
    import yaml

    return {k: v for k, v in yaml.safe_load((run_dir / "config.yaml").read_text()).items() if k not in IGNORED}


def against_preset_target(preset: str, run_dir: Path, summary: dict) -> dict:
    """A run that trained on past the preset's target (a soak has none): when it first reached the preset's
    target within the preset's time limit, read from its metrics as the run itself would have stopped."""
    import csv

    stop = load_config(preset).stop
    key = {"train": "env/return_mean100", "eval": "eval/return_mean", "eval_win_rate": "eval/win_rate"}[
        stop.target_metric
    ]
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(key) not in (None, "", "nan")]
    limit = stop.max_wall_time_s or float("inf")
    hit = next((r for r in rows if float(r[key]) >= stop.target_return and float(r["time_s"]) <= limit), None)
    last = [r for r in rows if float(r["time_s"]) <= limit] or rows[-1:]
    return {
        **summary,
        "target_reached": hit is not None,
        "time_to_target_s": float(hit["time_s"]) if hit else None,
        "env_steps_to_target": int(float(hit["env_steps"])) if hit else None,
        "return_at_target": float(hit[key]) if hit else None,
        "env_steps": int(float(last[-1]["env_steps"])),
        "wall_time_s": float(last[-1]["time_s"]),
    }


def presets_from_runs(args: argparse.Namespace) -> None:
    """Rows from runs already made (a staleness ablation's, a soak's): each must be the preset's config but for
    its seed (and where it logged). A run whose stop conditions differ (a soak trains on past the target) is
    judged on its metrics against the preset's own target and time limit."""
    out = Path(args.out)
    saved = (
        {row["preset"]: row for row in json.loads(out.with_suffix(".json").read_text())}
        if out.with_suffix(".json").exists()
        else {}
    )
    for item in args.from_runs:
        preset, _, dirs = item.partition("=")
        expected = {k: v for k, v in load_config(preset).model_dump(mode="json").items() if k not in IGNORED}
        runs = []
        for run_dir in (Path(d) for d in dirs.split(",")):
            given = preset_config_of(run_dir)
            different = sorted(k for k in expected if given.get(k) != expected[k] and k != "stop")
            if different:
                raise SystemExit(f"{run_dir} is not a run of {preset}: its {', '.join(different)} differ")
            summary = json.loads((run_dir / "summary.json").read_text())
            if given.get("stop") != expected["stop"]:
                summary = against_preset_target(preset, run_dir, summary)
            runs.append({**summary, "seed": load_config(str(run_dir / "config.yaml")).seed})
        saved[preset] = summarize(preset, runs)
    rows = [saved[name] for name in sorted(saved)]
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    if out == RESULTS / "zoo":
        update_page_tables("zoo table", markdown(rows))


if __name__ == "__main__":
    main()
