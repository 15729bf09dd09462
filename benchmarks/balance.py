"""The lag bound chosen online against the best fixed one: wall time to a target from deliberately poor starts.

    python benchmarks/balance.py [--task pong|pong18|cartpole|smax] [--seeds N] [--first-seed 0]
                                 [--starts best tight loose] [--modes fixed auto] [--minutes CAP]
                                 [--run-root runs/balance] [--set key=value ...]

Each start is a layout and a lag bound (`best`: the preset's own, tuned by hand; `tight`: bound 1, 2 actors;
`loose`: bound 8, 4 actors, 4 fragments in flight). Every start runs twice per seed: `fixed` (the bound as
given, all run long) and `auto` (`balance.max_policy_lag: auto` from that bound: the controller moves the
bound and the credits while the run goes on). Each run is one `tianji train PRESET` command, one at a time,
capped at --minutes; runs already finished under --run-root are read, not run again, so the script can be
stopped and started again, and results gather over sittings by (task/start/mode, seed).

Tasks: `pong` (pong-ppo to a 100-episode mean of -10, 5 seeds), `pong18` (the same to 18, one seed),
`cartpole` (cartpole-ppo to 475, 10 seeds), `smax` (smax-3m-mappo to its greedy win rate, 3 seeds).
The table: per start, the median wall time to the target (each seed; a run that missed it counts as over
the cap), fixed and auto, auto's median against the best fixed setting's (goal: within 10 %) and against the
poor start's own fixed median (goal: below it), the bound auto ended at and the env steps. The figure shows,
per start, the bound auto chose over time above the score. Results: benchmarks/results/balance-TASK.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from common import Sittings, curve, finished, machine, machines_of, metric_rows, run_tianji, summary_of

RESULTS = Path(__file__).parent / "results"
MODES = ("fixed", "auto")
GOAL_VS_BEST = 1.10  # auto's median time to target, at most this times the best fixed setting's


@dataclass(frozen=True)
class Start:
    """Where a run starts: its lag bound, actors and fragments in flight per actor."""

    name: str
    bound: int
    actors: int
    inflight: int

    def settings(self, mode: str) -> list[str]:
        lag = ["balance.max_policy_lag=auto", f"balance.lag_start={self.bound}"] if mode == "auto" else []
        return [
            *(lag or [f"balance.max_policy_lag={self.bound}"]),
            f"topology.actors={self.actors}",
            f"balance.max_inflight={self.inflight}",
        ]

    def label(self) -> str:
        return f"{self.name} (bound {self.bound}, {self.actors} actors, {self.inflight} in flight)"


@dataclass(frozen=True)
class Task:
    preset: str
    seeds: int
    cap_min: float
    best: Start  # the preset's own setting, tuned by hand
    target: tuple[str, ...] = ()  # settings that change the preset's target
    score: str = "env/return_mean100"  # the curve under the bound in the figure


POOR = (Start("tight", 1, 2, 2), Start("loose", 8, 4, 4))
TASKS = {
    "pong": Task("pong-ppo", 5, 30.0, Start("best", 4, 2, 2), ("stop.target_return=-10",)),
    "pong18": Task("pong-ppo", 1, 60.0, Start("best", 4, 2, 2)),
    "cartpole": Task("cartpole-ppo", 10, 3.0, Start("best", 8, 2, 3)),
    "smax": Task("smax-3m-mappo", 3, 20.0, Start("best", 8, 2, 2), score="eval/win_rate"),
}


def starts_of(task: Task) -> dict[str, Start]:
    return {start.name: start for start in (task.best, *POOR)}


def run_row(task_name: str, start: Start, mode: str, run_dir: Path, cap_min: float) -> dict:
    """One finished run, read from its directory (capped at `cap_min` minutes)."""
    summary, rows = summary_of(run_dir), metric_rows(run_dir)
    bounds = [r["balance/lag_bound"] for r in rows if r.get("balance/lag_bound") is not None]
    return {
        "name": f"{task_name}/{start.name}/{mode}",
        "task": task_name,
        "start": start.name,
        "mode": mode,
        "seed": int(run_dir.name.rsplit("-s", 1)[1]),
        "reached": bool(summary.get("target_reached")),
        "time_to_target_s": summary.get("time_to_target_s"),
        "env_steps_to_target": summary.get("env_steps_to_target"),
        "wall_time_s": summary.get("wall_time_s"),
        "cap_min": cap_min,
        "env_steps": summary.get("env_steps"),
        "lag_mean": summary.get("policy_lag_mean"),
        "bound_last": bounds[-1] if bounds else None,
        "bound_range": [min(bounds), max(bounds)] if bounds else None,
        "bound_curve": curve(rows, "balance/lag_bound", every=3),
        "score_curve": curve(rows, TASKS[task_name].score, every=3),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
    }


def time_or_inf(run: dict) -> float:
    """Seconds to the target; a run that missed it counts as slower than any that reached it."""
    return run["time_to_target_s"] if run["reached"] and run["time_to_target_s"] is not None else math.inf


def median_time(runs: list[dict]) -> float | None:
    return statistics.median(map(time_or_inf, runs)) if runs else None


def _minutes(seconds: float | None, cap_min: float) -> str:
    """A time to the target as read best: seconds under two minutes (CartPole), else minutes."""
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return f">{cap_min:g} min"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isinf(b) or b == 0:
        return None
    return a / b


def markdown(task_name: str, runs: list[dict]) -> str:
    task = TASKS[task_name]
    runs = [r for r in runs if r["task"] == task_name]
    of = {
        (s, m): sorted((r for r in runs if r["start"] == s and r["mode"] == m), key=lambda r: r["seed"])
        for s in starts_of(task)
        for m in MODES
    }
    best = median_time(of[(task.best.name, "fixed")])
    lines = [
        f"# The lag bound chosen online: `{task.preset}`{' ' + ', '.join(task.target) if task.target else ''}",
        "",
        f"Machine: {machines_of(runs) if runs else machine()}. Each run capped at {_caps(runs, task.cap_min)} "
        "minutes; one run at a time. Time: wall time from the command's start to the target; a run that missed "
        "it counts as over the cap. auto: `balance.max_policy_lag: auto` started from the start's bound.",
        "",
        "| start | fixed: median time (each seed) | auto: median time (each seed) | auto / best fixed | "
        "auto / this start fixed | auto's bound at the end (range) | env steps to target, fixed / auto |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, start in starts_of(task).items():
        fixed, auto = of[(name, "fixed")], of[(name, "auto")]
        if not fixed and not auto:
            continue
        fixed_t, auto_t = median_time(fixed), median_time(auto)
        vs_best, vs_own = _ratio(auto_t, best), _ratio(auto_t, fixed_t)
        lines.append(
            f"| {start.label()} | {_cell(fixed, fixed_t, task.cap_min)} | {_cell(auto, auto_t, task.cap_min)} | "
            f"{_fmt_ratio(vs_best)} | {_fmt_ratio(vs_own)} | {_bounds(auto)} | "
            f"{_steps(fixed)} / {_steps(auto)} |"
        )
        if name != task.best.name and auto:
            within = vs_best is not None and vs_best <= GOAL_VS_BEST
            below = fixed_t is not None and auto_t is not None and auto_t < fixed_t
            verdicts.append(
                f"- from {name}: auto {'within' if within else 'NOT within'} {GOAL_VS_BEST - 1:.0%} of the best fixed "
                f"median ({_fmt_ratio(vs_best)}); {'below' if below else 'NOT below'} its own fixed median."
            )
    return "\n".join([*lines, "", *verdicts, ""])


def _cap(run: dict, default_min: float) -> float:
    """The cap a run ran under: its sitting's --minutes (rows from before it was kept: the task's)."""
    return run.get("cap_min") or default_min


def _caps(runs: list[dict], default_min: float) -> str:
    return " / ".join(f"{c:g}" for c in sorted({_cap(r, default_min) for r in runs} or {default_min}))


def _cell(runs: list[dict], median: float | None, default_cap_min: float) -> str:
    """The median and each seed's time; a miss reads as over its own run's cap."""
    if not runs:
        return "-"
    each = ", ".join(_minutes(time_or_inf(r), _cap(r, default_cap_min)) for r in runs)
    longest = max(_cap(r, default_cap_min) for r in runs)
    return f"{_minutes(median, longest)} ({each}; {sum(r['reached'] for r in runs)}/{len(runs)} reached)"


def _fmt_ratio(ratio: float | None) -> str:
    """A ratio of medians; a median over the cap (most runs missed the target) has no ratio to show."""
    if ratio is None:
        return "-"
    return "over the cap" if math.isinf(ratio) else f"{ratio:.2f}x"


def _bounds(runs: list[dict]) -> str:
    ended = [r["bound_last"] for r in runs if r["bound_last"] is not None]
    ranges = [r["bound_range"] for r in runs if r["bound_range"]]
    if not ended:
        return "-"
    low, high = min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
    return f"{statistics.median(ended):g} ({low:g}-{high:g})"


def _steps(runs: list[dict]) -> str:
    steps = [r["env_steps_to_target"] for r in runs if r["reached"] and r["env_steps_to_target"]]
    return f"{statistics.median(steps) / 1e6:.2f}M" if steps else "-"


def figure(task_name: str, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = TASKS[task_name]
    auto = [r for r in runs if r["task"] == task_name and r["mode"] == "auto"]
    names = [name for name in starts_of(task) if any(r["start"] == name for r in auto)]
    if not names:
        return
    fig, axes = plt.subplots(2, len(names), figsize=(4.5 * len(names), 5.5), squeeze=False, sharex="col")
    for column, name in enumerate(names):
        for run in sorted((r for r in auto if r["start"] == name), key=lambda r: r["seed"]):
            for row, key in ((0, "bound_curve"), (1, "score_curve")):
                if run[key]:
                    axes[row][column].plot(*zip(*run[key], strict=True), label=f"seed {run['seed']}")
        axes[0][column].set_title(starts_of(task)[name].label(), fontsize=9)
        axes[0][column].set_ylabel("lag bound (auto)")
        axes[1][column].set_ylabel(task.score)
        axes[1][column].set_xlabel("minutes")
        axes[0][column].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="pong")
    parser.add_argument("--seeds", type=int, help="default: the task's")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--starts", nargs="+", default=["best", *(s.name for s in POOR)])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--minutes", type=float, help="each run's cap (default: the task's)")
    parser.add_argument("--run-root", type=Path, default=Path("runs/balance"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="an override for every run")
    parser.add_argument("--out", help="results path without suffix (default: benchmarks/results/balance-TASK)")
    args = parser.parse_args()
    task = TASKS[args.task]
    cap_min = args.minutes or task.cap_min
    out = Path(args.out or RESULTS / f"balance-{args.task}")
    sittings = Sittings(out, "name")
    seeds = range(args.first_seed, args.first_seed + (args.seeds or task.seeds))
    for seed in seeds:  # seed by seed: a sitting cut short still has whole comparisons
        for name in args.starts:
            start = starts_of(task)[name]
            for mode in args.modes:
                run_dir = args.run_root / args.task / f"{name}-{mode}-s{seed}"
                if not finished(run_dir):
                    settings = [*start.settings(mode), *task.target, f"stop.max_wall_time_s={cap_min * 60}"]
                    run_tianji(task.preset, run_dir, seed, [*settings, *args.overrides])
                sittings.add(run_row(args.task, start, mode, run_dir, cap_min))
                print(sittings.save(lambda rows: markdown(args.task, rows)), flush=True)
                figure(args.task, sittings.ordered(), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
