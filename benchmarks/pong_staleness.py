"""The paper's staleness ablation on Pong: every setting equal except the policy-lag bound.

    python benchmarks/pong_staleness.py [--preset pong-ppo] [--bounds 0 1 2 4 8] [--seeds 1] [--two-seeds 0 4]
                                        [--correction on off] [--variant NAME:SETTING,...] [--inflight 2]
                                        [--actors-for 8:4] [--max-env-steps 1100000] [--minutes 40]

Each run is one `tianji train PRESET --set balance.max_policy_lag=B` command (with
`algo.stale_correction` on or off: the stale-fragment correction; "on" with its clip centred on the learner's
policy, `algo.clip_anchor=proximal`, as every "on" run was made), one after another, never two at once.
A `--variant` runs the bounds again with the correction on and more settings, e.g.
`--variant anchored:algo.clip_anchor=behaviour` (the clip anchored at the actors' policy),
`--bounds 0 --variant delay2:balance.publish_delay=2` (a synchronous run whose data are 2 versions old:
data age without asynchrony), `--bounds 0 --variant
jitter:balance.publish_delay=4,balance.publish_delay_varies=true` (a synchronous run whose data age is
drawn from 0-4 per publish, as it varies at bound 4) or `--variant step:balance.refresh_weights=step`
(actors take new weights between env steps).
Enough fragments may be in flight to reach the bound (`balance.max_inflight`, and `--actors-for B:N`
gives a bound more actors). The table reports, per run and within the budget, the lag measured, the env
steps and the minutes to a 100-episode mean of -15, -10, -5, 0, 12 and 18 (where reached), the mean at
fixed env steps, and how many env steps each run needed relative to the synchronous one (bound 0) of the
same seed; the verdict lines say whether each bound is within 10 % of it (median over seeds) and how far
its curve is from the synchronous one, in game points, averaged over the budget. A run directory may
also be a link to another finished run of the same settings (the zoo's run of the preset, for its bound).
Runs already finished (stopped by their own budget, or interrupted past it) are read, not run again,
so the script can be stopped and restarted; the table also shows every other finished run under
--run-root, so invocations with different bounds or corrections add up, and `--earlier RESULTS.json`
adds the rows of runs whose directories are gone (made on another machine or day; the figure shows
them at the table's 0.1M-step grid, against env steps only).
Results: benchmarks/results/pong-staleness.{md,json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common import train_command

THRESHOLDS = (-15.0, -10.0, -5.0, 0.0, 12.0, 18.0)
CHECKPOINTS_M = (0.6, 0.8, 1.0)  # env steps (millions) at which the table shows each run's score
GRID_M = tuple(round(0.1 * i, 1) for i in range(2, 12))  # where two curves are compared point by point
BUDGET_SLACK = 1.02  # a run stops at the first metrics row past its budget
RESULTS = Path(__file__).parent / "results"


SYNC = ("on", "off")  # bound 0 with either is PPO exactly: the synchronous reference
REPEATS = ("rerun",)  # variants that run a synchronous reference again (the noise floor); pooled with it


def run_name(bound: int, variant: str, seed: int) -> str:
    return f"lag{bound}-{variant}-s{seed}"


def variant_settings(spec: str) -> tuple[str, list[str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` -> (NAME, settings); the correction stays on."""
    name, _, settings = spec.partition(":")
    if not name.isalnum() or name in ("on", "off") or not settings:
        raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME:KEY=VALUE[,...], NAME alphanumeric")
    return name, settings.split(",")


def train(preset: str, run_dir: Path, bound: int, variant: str, seed: int, args: argparse.Namespace) -> None:
    actors = dict(args.actors_for).get(bound)
    settings = [
        f"seed={seed}",
        f"balance.max_policy_lag={bound}",
        f"balance.max_inflight={max(1, args.inflight)}",
        f"algo.stale_correction={'false' if variant == 'off' else 'true'}",
        *(["algo.clip_anchor=proximal"] if variant == "on" else []),  # what every "on" run measured
        *dict(args.variant).get(variant, []),
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


def metric_rows(run_dir: Path, max_env_steps: float) -> list[dict]:
    """The run's metrics rows up to the budget (runs taken from elsewhere, e.g. the zoo's, went on)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if float(r["env_steps"]) <= max_env_steps * BUDGET_SLACK]


def curve(rows: list[dict]) -> list[tuple[float, int, float]]:
    """(seconds, env steps, 100-episode mean) of every metrics row with a score."""
    return [
        (float(r["time_s"]), int(float(r["env_steps"])), float(r["env/return_mean100"]))
        for r in rows
        if r["env/return_mean100"] not in ("", "nan")
    ]


def column(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "", "nan")]


def score_at(points: list[tuple[float, int, float]], env_steps: float) -> float | None:
    """The 100-episode mean at the last metrics row at or before env_steps."""
    before = [score for _, steps, score in points if steps <= env_steps]
    return before[-1] if before and points[-1][1] >= env_steps * 0.98 else None


def minutes_at(points: list[tuple[float, int, float]], env_steps: float) -> float | None:
    """Minutes from the start at the metrics row `score_at` reads (so --earlier rows keep a wall-time curve)."""
    before = [t for t, steps, _ in points if steps <= env_steps]
    return before[-1] / 60 if before and points[-1][1] >= env_steps * 0.98 else None


def first_reaching(points: list[tuple[float, int, float]], threshold: float) -> tuple[float, int] | None:
    return next(((t, steps) for t, steps, score in points if score >= threshold), None)


def finished(run_dir: Path, max_env_steps: float) -> bool:
    """A run counts once it stopped by itself, or was interrupted (Ctrl-C, a session's end) after its budget."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return False
    summary = json.loads(summary_path.read_text())
    return summary.get("stop_reason") != "interrupted" or summary["env_steps"] >= max_env_steps


def describe(run_dir: Path, bound: int, variant: str, seed: int, max_env_steps: float) -> dict:
    """One run within the budget: lag, speed, env steps and minutes to each threshold, score at checkpoints."""
    rows = metric_rows(run_dir, max_env_steps)
    points = curve(rows)
    last = rows[-1]
    reached = {str(int(x)): first_reaching(points, x) for x in THRESHOLDS}
    lag_means = column(rows, "balance/lag_mean")
    return {
        "run": run_dir.name,
        "bound": bound,
        "variant": variant,
        "seed": seed,
        "lag_mean": statistics.fmean(lag_means) if lag_means else 0.0,
        "lag_max": int(max(column(rows, "balance/lag_max"), default=0)),
        "fragments_dropped": int(float(last["balance/fragments_dropped"] or 0)),
        "env_steps": int(float(last["env_steps"])),
        "wall_time_s": float(last["time_s"]),
        "env_steps_per_s": float(last["env_steps"]) / max(float(last["time_s"]), 1e-9),
        "final_score": points[-1][2] if points else None,
        "score_at": {f"{m:g}M": score_at(points, m * 1e6) for m in sorted({*CHECKPOINTS_M, *GRID_M})},
        "minutes_at": {f"{m:g}M": minutes_at(points, m * 1e6) for m in sorted({*CHECKPOINTS_M, *GRID_M})},
        "reached": {k: (None if v is None else {"minutes": v[0] / 60, "env_steps": v[1]}) for k, v in reached.items()},
    }


def earlier_runs(run_root: Path, taken: set[str], max_env_steps: float) -> list[dict]:
    """Finished runs of earlier invocations (other bounds, seeds or corrections), so that the table grows
    across invocations instead of showing only the last one's runs."""
    rows = []
    for run_dir in sorted(run_root.glob("lag*-*-s*")):
        if run_dir.name in taken or not finished(run_dir, max_env_steps):
            continue
        bound, variant, seed = run_dir.name.split("-")
        rows.append(describe(run_dir, int(bound[len("lag") :]), variant, int(seed[len("s") :]), max_env_steps))
    return rows


def steps_ratio(row: dict, base: dict, key: str) -> tuple[float, str] | None:
    """Env steps to a score, this run's over the synchronous run's, and "" when both reached it; when only
    one did, the bound its budget gives: "<" (the synchronous run would need more than it ran) or ">"."""
    hit, base_hit = row["reached"][key], base["reached"][key]
    if hit is not None and base_hit is not None:
        return hit["env_steps"] / base_hit["env_steps"], ""
    if hit is not None:
        return hit["env_steps"] / base["env_steps"], "<"
    if base_hit is not None:
        return row["env_steps"] / base_hit["env_steps"], ">"
    return None


def mean_score_gap(row: dict, base: dict) -> float | None:
    """row's 100-episode mean minus base's, averaged over the env-step grid points both runs reached."""
    gaps = [
        row["score_at"][k] - base["score_at"][k]
        for k in (f"{m:g}M" for m in GRID_M)
        if row["score_at"].get(k) is not None and base["score_at"].get(k) is not None
    ]
    return statistics.fmean(gaps) if gaps else None


def relative_to_synchronous(rows: list[dict]) -> None:
    """Each run's env steps to each threshold / the synchronous run's of the same seed, and its score minus
    the synchronous run's averaged over the env-step grid (with no lag the correction changes nothing:
    one synchronous run serves both)."""
    sync = {r["seed"]: r for r in rows if is_sync(r)}
    for row in rows:
        base = sync.get(row["seed"])
        row["steps_vs_sync"] = {}
        row["score_gap"] = None
        if base is None:
            continue
        for key in row["reached"]:
            ratio = steps_ratio(row, base, key)
            if ratio is not None:
                row["steps_vs_sync"][key] = ratio
        row["score_gap"] = mean_score_gap(row, base)


def is_sync(row: dict) -> bool:
    return row["bound"] == 0 and row["variant"] in SYNC


def is_reference(row: dict) -> bool:
    """A synchronous run, or one run again (REPEATS): what the pooled and averaged comparisons measure against."""
    return is_sync(row) or (row["bound"] == 0 and row["variant"] in REPEATS)


def grid_keys(max_env_steps: float) -> list[str]:
    """The grid's env steps within the budget, as `score_at`'s keys."""
    return [f"{m:g}M" for m in GRID_M if m * 1e6 <= max_env_steps * BUDGET_SLACK]


def grid_scores(row: dict, keys: list[str]) -> list[float] | None:
    """The run's scores at every key, or None where it has a gap (a run stopped short of the budget)."""
    values = [row["score_at"].get(k) for k in keys]
    return None if None in values else values


def table(rows: list[dict], args: argparse.Namespace, variants: dict[str, list[str]]) -> str:
    def cell(hit: dict | None) -> str:
        return "-" if hit is None else f"{hit['env_steps'] / 1e6:.2f}M / {hit['minutes']:.1f} min"

    def number(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    keys = [str(int(x)) for x in THRESHOLDS]
    lines = [
        f"# Pong: policy-lag bound ablation (`{args.preset}`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {_cores()} cores; {time.strftime('%Y-%m-%d')}. "
        f"Budget per run: {args.max_env_steps / 1e6:.1f}M env steps or {args.minutes:.0f} minutes. "
        "Every setting equal except the bound and the variant; runs one at a time. "
        "Env steps / minutes to each 100-episode mean, and the mean at fixed env steps. "
        "Variants: on / off: the stale-fragment correction (algo.stale_correction) with its clip centred on the "
        "learner's policy (algo.clip_anchor=proximal, the default) / none; "
        + "".join(f"{name}: the correction on, {', '.join(sets)}; " for name, sets in sorted(variants.items()))
        + "lag counts from the version a fragment started with.",
        "",
        "| run | bound | variant | lag mean / max | dropped | env steps/s | "
        + " | ".join(keys)
        + " | "
        + " | ".join(f"at {m:g}M" for m in CHECKPOINTS_M)
        + " | env steps vs bound 0 (to "
        + " / ".join(keys)
        + ") |",
        "|" + "---|" * (7 + len(keys) + len(CHECKPOINTS_M)),
    ]
    for r in sorted(rows, key=lambda r: (r["variant"], r["bound"], r["seed"])):
        ratios = " / ".join(ratio_text(r["steps_vs_sync"].get(k)) for k in keys)
        lines.append(
            f"| {r['run']} | {r['bound']} | {r['variant']} | {r['lag_mean']:.1f} / {r['lag_max']} | "
            f"{r['fragments_dropped']} | {r['env_steps_per_s']:,.0f} | "
            + " | ".join(cell(r["reached"][k]) for k in keys)
            + " | "
            + " | ".join(number(r["score_at"][f"{m:g}M"]) for m in CHECKPOINTS_M)
            + f" | {ratios} |"
        )
    lines += ["", *verdict(rows), *noise_floor(rows), "", *pooled(rows), "", *mean_curves(rows, args.max_env_steps)]
    return "\n".join(lines) + "\n"


def ratio_text(ratio: tuple[float, str] | None) -> str:
    return "-" if ratio is None else f"{ratio[1]}{ratio[0]:.2f}"


def verdict(rows: list[dict]) -> list[str]:
    """Per bound and variant: env steps to each threshold relative to bound 0's, per seed, and whether
    their median is within 10 % for every threshold (the issue's bar for "stale fragments cost nothing");
    "<" and ">" mark bounds where only one of the two runs reached a score within the budget."""
    ratios: dict[tuple[str, int], dict[str, list[tuple[float, str]]]] = {}
    gaps: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if is_sync(r):
            continue
        for key, ratio in r.get("steps_vs_sync", {}).items():
            ratios.setdefault((r["variant"], r["bound"]), {}).setdefault(key, []).append(ratio)
        if r.get("score_gap") is not None:
            gaps.setdefault((r["variant"], r["bound"]), []).append(r["score_gap"])
    lines = []
    for (variant, bound), by_key in sorted(ratios.items()):
        within = all(statistics.median(value for value, _ in values) <= 1.10 for values in by_key.values())
        shown = "; ".join(f"{key}: {', '.join(ratio_text(v) for v in values)}" for key, values in by_key.items())
        gap = gaps.get((variant, bound), [])
        lines.append(
            f"- bound {bound}, variant {variant}, {len(gap)} seed(s): env steps to each score over the "
            f"synchronous run's ({shown}): median "
            + ("within 10 %" if within else "NOT within 10 %")
            + (
                f"; score minus the synchronous run's, averaged every 0.1M env steps "
                f"from {GRID_M[0]:g}M to the budget: " + ", ".join(f"{g:+.1f}" for g in gap) + " points"
                if gap
                else ""
            )
        )
    return lines


def median_steps(runs: list[dict], key: str) -> float:
    """The median env steps to a score over runs; a run that did not reach it counts as never (inf)."""
    return statistics.median(r["reached"][key]["env_steps"] if r["reached"][key] else float("inf") for r in runs)


def pooled(rows: list[dict]) -> list[str]:
    """Runs of one setting against all synchronous runs, medians over runs rather than seed by seed: neither
    kind of run repeats itself (the synchronous run of seed 0, run again, reached -15 after 0.85x the env
    steps), so pairing by seed carries no information and a median over every run is the steadier test."""
    sync = [r for r in rows if is_reference(r)]
    if not sync:
        return []
    keys = [str(int(x)) for x in THRESHOLDS[:3]]
    base = {key: median_steps(sync, key) for key in keys}

    def steps(x: float) -> str:
        return "never" if x == float("inf") else f"{x / 1e6:.2f}M"

    def ratio(x: float, reference: float) -> str:
        if reference == float("inf"):
            return "-"
        return ">" if x == float("inf") else f"{x / reference:.2f}x"

    lines = [
        f"Pooled: median env steps to {' / '.join(keys)} over runs, against the {len(sync)} synchronous runs' "
        f"({' / '.join(steps(base[k]) for k in keys)}); a run that did not reach a score within the budget "
        "counts as never reaching it."
    ]
    settings = sorted({(r["variant"], r["bound"]) for r in rows if r not in sync})
    for variant, bound in settings:
        runs = [r for r in rows if (r["variant"], r["bound"]) == (variant, bound)]
        medians = {key: median_steps(runs, key) for key in keys}
        lines.append(
            f"- bound {bound}, {variant}, {len(runs)} run(s): {' / '.join(steps(medians[k]) for k in keys)}, "
            f"{' / '.join(ratio(medians[k], base[k]) for k in keys)}"
        )
    return lines


BOOTSTRAP_DRAWS = 2000
MEAN_CURVE_SCORES = (-15.0, -10.0, -5.0)
MIN_RUNS = 3  # two runs give a bootstrap four draws: their interval is no more than the two runs' range


def crossing(grid: np.ndarray, curve: np.ndarray, score: float) -> float:
    """Env steps at which a curve sampled on `grid` first reaches `score`, linearly interpolated (inf: never)."""
    for i in np.flatnonzero(curve >= score):
        if i == 0:
            return float(grid[0])
        return float(grid[i - 1] + (score - curve[i - 1]) / (curve[i] - curve[i - 1]) * (grid[i] - grid[i - 1]))
    return float("inf")


def mean_curve_ratios(runs: np.ndarray, sync: np.ndarray, grid: np.ndarray) -> list[float]:
    """Env steps for the runs' average curve to reach each score over the synchronous runs' average's."""
    mean, reference = runs.mean(axis=0), sync.mean(axis=0)
    return [crossing(grid, mean, s) / crossing(grid, reference, s) for s in MEAN_CURVE_SCORES]


def mean_curves(rows: list[dict], max_env_steps: float) -> list[str]:
    """Each setting's runs averaged point by point against the synchronous runs' average: the env steps each
    average needs to reach -15, -10 and -5, as a ratio, with a 90 % bootstrap interval (runs drawn again with
    replacement within each group). Averaging curves before reading a score off them uses every point of
    every run, so it is steadier than medians of single runs' crossings; a bound's cost is decided only
    where its interval lies wholly on one side of 1.10, and shown for settings of three runs or more."""
    keys = grid_keys(max_env_steps)

    def scores(r: dict) -> list[float] | None:
        return grid_scores(r, keys)

    sync_rows = [r for r in rows if is_reference(r)]
    sync = np.array([s for s in map(scores, sync_rows) if s is not None])
    if len(sync) < 2:
        return []
    grid = np.array([float(k[:-1]) * 1e6 for k in keys])
    rng = np.random.default_rng(0)
    names = " / ".join(f"{s:g}" for s in MEAN_CURVE_SCORES)
    reference = " / ".join(f"{crossing(grid, sync.mean(axis=0), s) / 1e6:.2f}M" for s in MEAN_CURVE_SCORES)
    lines = [
        f"Mean curves: env steps for each setting's average curve to reach {names}, over the {len(sync)} "
        f"synchronous runs' average ({reference}), "
        f"with a 90 % interval ({BOOTSTRAP_DRAWS} bootstrap draws of the runs; never: not within the budget); "
        "within 10 %: the whole interval "
        "at or under 1.10, NOT: the whole interval over it, undecided: neither."
    ]
    sync_by_seed = by_seed([r for r in sync_rows if scores(r)], scores)
    paired = []
    for variant, bound in sorted({(r["variant"], r["bound"]) for r in rows if r not in sync_rows}):
        setting = [r for r in rows if (r["variant"], r["bound"]) == (variant, bound) and scores(r)]
        runs = np.array([scores(r) for r in setting])
        if len(runs) >= MIN_RUNS:
            lines.append(f"- bound {bound}, {variant}, {len(runs)} runs: " + interval_text(runs, sync, grid, rng))
        mine = by_seed(setting, scores)
        seeds = sorted(set(mine) & set(sync_by_seed))
        if len(seeds) >= MIN_RUNS:
            pairs = np.array([[mine[s], sync_by_seed[s]] for s in seeds])
            seed_list = ", ".join(map(str, seeds))
            paired.append(f"- bound {bound}, {variant}, seeds {seed_list}: " + paired_text(pairs, grid, rng))
    return lines + [
        "",
        "Seed-matched: the same, each setting against the synchronous runs of its own seeds (a seed's runs "
        "averaged first), the seeds drawn again in pairs: some seeds are easy for every setting (seeds 4 and "
        "5 reached -10 by 0.6M held synchronous and at bound 4), so a setting run on other seeds than the "
        "reference is compared with different luck.",
        *paired,
    ]


def by_seed(runs: list[dict], scores: Callable[[dict], list[float] | None]) -> dict[int, np.ndarray]:
    """Each seed's curve: the average of its runs (a synchronous seed run twice counts once)."""
    seeds: dict[int, list] = {}
    for r in runs:
        seeds.setdefault(r["seed"], []).append(scores(r))
    return {seed: np.mean(curves, axis=0) for seed, curves in seeds.items()}


def paired_text(pairs: np.ndarray, grid: np.ndarray, rng: np.random.Generator) -> str:
    """Mean-curve ratios of pairs [seed, (setting, synchronous), grid], seeds resampled together."""
    point = mean_curve_ratios(pairs[:, 0], pairs[:, 1], grid)
    draws = []
    for _ in range(BOOTSTRAP_DRAWS):
        drawn = pairs[rng.integers(len(pairs), size=len(pairs))]
        draws.append(mean_curve_ratios(drawn[:, 0], drawn[:, 1], grid))
    return verdict_text(point, np.array(draws))


def interval_text(runs: np.ndarray, sync: np.ndarray, grid: np.ndarray, rng: np.random.Generator) -> str:
    """The mean-curve ratios of `runs` against `sync`, their 90 % bootstrap intervals and the verdict."""

    def resampled(group: np.ndarray) -> np.ndarray:
        return group[rng.integers(len(group), size=len(group))]

    point = mean_curve_ratios(runs, sync, grid)
    draws = np.array([mean_curve_ratios(resampled(runs), resampled(sync), grid) for _ in range(BOOTSTRAP_DRAWS)])
    return verdict_text(point, draws)


def verdict_text(point: list[float], draws: np.ndarray) -> str:
    """Ratios, their 90 % intervals over the bootstrap draws, and the verdict against 1.10."""
    low = np.percentile(draws, 5, axis=0, method="lower")  # no interpolation: a draw may never reach a score
    high = np.percentile(draws, 95, axis=0, method="higher")
    words = "within 10 %" if (high <= 1.10).all() else "NOT within 10 %" if (low > 1.10).any() else "undecided"
    parts = zip(MEAN_CURVE_SCORES, point, low, high, strict=True)
    return ", ".join(f"{s:g}: {times(p)} [{times(lo)}, {times(hi)}]" for s, p, lo, hi in parts) + f": {words}"


def times(ratio: float) -> str:
    return "never" if ratio == float("inf") else f"{ratio:.2f}x"


def noise_floor(rows: list[dict]) -> list[str]:
    """How far apart two seeds of the same synchronous configuration land: the resolution of the verdicts above."""
    sync = sorted((r for r in rows if is_sync(r)), key=lambda r: r["seed"])
    if len(sync) < 2:
        return []
    a, b = sync[:2]
    both = {key: steps_ratio(b, a, key) for key in a["reached"]}
    ratios = ", ".join(f"{key}: {r[0]:.2f}" for key, r in both.items() if r is not None and not r[1])
    missed = [key for key, r in both.items() if r is not None and r[1]]
    gap = mean_score_gap(b, a)
    return [
        f"- noise floor: bound 0 seed {b['seed']} against seed {a['seed']}, same configuration: env steps to each "
        f"score ({ratios})"
        + (f", {' and '.join(missed)} reached by one seed only" if missed else "")
        + (f"; score gap averaged over the budget {gap:+.1f} points" if gap is not None else "")
    ]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def figure(rows: list[dict], run_root: Path, out: Path, max_env_steps: float, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(21, 5))
    colours = [plt.get_cmap("tab20")(i) for i in range(20)]  # a colour per bound and variant, up to 20
    kinds = sorted({(r["variant"] != "on", r["variant"], r["bound"]) for r in rows if r["variant"] != "off"})
    for r in rows:
        points = plotted_curve(r, run_root, max_env_steps)
        kind = (r["variant"] != "on", r["variant"], r["bound"])
        colour = "black" if r["variant"] == "off" else colours[kinds.index(kind) % len(colours)]
        style = ":" if r["variant"] == "off" else ("-" if r["seed"] == 0 else "--")  # seeds, correction apart
        label = f"lag <= {r['bound']}, {r['variant']}, seed {r['seed']}"
        axes[0].plot([p[1] / 1e6 for p in points], [p[2] for p in points], style, color=colour, label=label)
        timed = [p for p in points if p[0] is not None]
        axes[1].plot([p[0] / 60 for p in timed], [p[2] for p in timed], style, color=colour, label=label)
    mean_curve_panel(axes[2], rows, max_env_steps, colours, kinds)
    for ax, label in (
        (axes[0], "env steps (millions)"),
        (axes[1], "wall time (minutes)"),
        (axes[2], "env steps (millions)"),
    ):
        ax.set_xlabel(label)
        ax.set_ylabel("100-episode mean game score")
        ax.grid(alpha=0.3)
        for threshold in THRESHOLDS:
            ax.axhline(threshold, color="grey", linewidth=0.5)
    axes[0].legend(fontsize="xx-small", ncol=2)
    axes[2].legend(fontsize="x-small")
    fig.suptitle(
        f"{preset}: policy-lag bounds side by side "
        "(colour: bound and variant; solid: seed 0, dashed: other seeds; dotted: no correction)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def mean_curve_panel(ax, rows: list[dict], max_env_steps: float, colours: list, kinds: list) -> None:
    """Each setting's runs (two or more) averaged at the grid, the synchronous runs' in black: what the
    mean-curve verdict reads."""
    keys = grid_keys(max_env_steps)
    sync_runs = [r for r in rows if is_reference(r)]
    settings = [("synchronous", sync_runs, "black")] + [
        (f"lag <= {bound}, {variant}", runs, colours[kinds.index((variant != "on", variant, bound)) % len(colours)])
        for variant, bound in sorted({(r["variant"], r["bound"]) for r in rows if r not in sync_runs})
        if variant != "off"
        for runs in [[r for r in rows if (r["variant"], r["bound"]) == (variant, bound)]]
    ]
    for label, runs, colour in settings:
        scored = [s for r in runs if (s := grid_scores(r, keys))]
        if len(scored) >= 2:
            mean = [statistics.fmean(column) for column in zip(*scored, strict=True)]
            ax.plot(
                [float(k[:-1]) for k in keys],
                mean,
                color=colour,
                label=f"{label} ({len(scored)} runs)",
                linewidth=2.5 if label == "synchronous" else 1.2,
            )
    ax.set_title("mean curves (settings with two or more runs)", fontsize="small")


def plotted_curve(row: dict, run_root: Path, max_env_steps: float) -> list[tuple[float | None, float, float]]:
    """The run's curve from its metrics, or, for a row of --earlier whose directory is gone, its scores at
    the grid's env steps (no times)."""
    if (run_root / row["run"] / "metrics.csv").exists():
        return list(curve(metric_rows(run_root / row["run"], max_env_steps)))
    minutes = row.get("minutes_at", {})  # rows of results files older than this field have no times
    grid = sorted(
        (float(key[:-1]) * 1e6, score, minutes.get(key)) for key, score in row["score_at"].items() if score is not None
    )
    return [(None if m is None else m * 60, steps, score) for steps, score, m in grid]


def earlier_results(paths: list[Path], taken: set[str]) -> tuple[list[dict], dict[str, list[str]]]:
    """Rows and variants of earlier results files, for runs not found under --run-root."""
    rows: list[dict] = []
    variants: dict[str, list[str]] = {}
    for path in paths:
        results = json.loads(path.read_text())
        variants.update(results.get("variants", {}))
        new = [r for r in results["runs"] if r["run"] not in taken and r["run"] not in {x["run"] for x in rows}]
        rows += [{"variant": r.get("correction"), **r} for r in new]  # files from before variants named it so
    return rows, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-ppo")
    parser.add_argument("--bounds", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, default=1, help="seeds per bound")
    parser.add_argument("--two-seeds", type=int, nargs="*", default=[0, 4], help="bounds run with 2 seeds")
    parser.add_argument("--correction", nargs="*", choices=["on", "off"], default=["on"])
    parser.add_argument(
        "--variant",
        type=variant_settings,
        action="append",
        default=[],
        metavar="NAME:SETTING,...",
        help="also run the bounds with the correction on and these settings (run names lagB-NAME-sS)",
    )
    parser.add_argument("--inflight", type=int, default=2, help="balance.max_inflight of every run (the preset's 2)")
    parser.add_argument(
        "--actors-for",
        type=lambda s: tuple(int(x) for x in s.split(":")),
        nargs="*",
        default=[(8, 4)],
        metavar="BOUND:ACTORS",
        help="topology.actors for a bound (to reach it)",
    )
    parser.add_argument("--max-env-steps", type=int, default=1_100_000, help="each run's budget")
    parser.add_argument("--minutes", type=float, default=40.0)
    parser.add_argument("--run-root", default="runs/pong-staleness")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--earlier",
        type=Path,
        action="append",
        default=[],
        metavar="RESULTS.json",
        help="an earlier results file: its runs join the table where their directories are not under --run-root",
    )
    parser.add_argument("--out", default=str(RESULTS / "pong-staleness"))
    args = parser.parse_args()
    run_root = Path(args.run_root)
    run_root.mkdir(parents=True, exist_ok=True)
    variants = remembered_variants(run_root, dict(args.variant))
    rows = []
    for variant in [*args.correction, *dict(args.variant)]:
        for bound in args.bounds:
            if bound == 0 and variant == "off" and "on" in args.correction:
                continue  # synchronous: the correction is PPO exactly, the run with it on serves both
            for seed in range(args.seeds + (1 if bound in args.two_seeds and args.seeds < 2 else 0)):
                run_dir = run_root / run_name(bound, variant, seed)
                if not finished(run_dir, args.max_env_steps):
                    print(f"{run_dir.name}: training ...", flush=True)
                    if run_dir.exists():
                        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                    train(args.preset, run_dir, bound, variant, seed, args)
                rows.append(describe(run_dir, bound, variant, seed, args.max_env_steps))
                print(f"{run_dir.name}: {rows[-1]['reached']}", flush=True)
    rows += earlier_runs(run_root, {r["run"] for r in rows}, args.max_env_steps)
    earlier_rows, earlier_variants = earlier_results(args.earlier, {r["run"] for r in rows})
    rows += earlier_rows
    variants = {**earlier_variants, **variants}
    relative_to_synchronous(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"preset": args.preset, "variants": variants, "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(table(rows, args, variants))
    figure(rows, run_root, out.with_suffix(".png"), args.max_env_steps, args.preset)
    print(table(rows, args, variants))


def remembered_variants(run_root: Path, new: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every variant's settings, this invocation's and earlier ones' (kept in RUN_ROOT/variants.json), so the
    table names what each run changed; a name given again with other settings is an error."""
    path = run_root / "variants.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    for name, settings in new.items():
        if known.get(name, settings) != settings:
            raise SystemExit(f"--variant {name}: its runs under {run_root} were made with {known[name]}")
    known.update(new)
    path.write_text(json.dumps(known, indent=2))
    return known


if __name__ == "__main__":
    main()
