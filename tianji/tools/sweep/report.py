"""What a sweep leaves for people: sweep.csv, best.yaml, a table sorted by the objective, and the
optimisation-history and parameter-importance plots (PNG, Optuna's matplotlib plots).

Rewritten after every finished trial (the plots at the end), so an interrupted sweep still has them.
"""

from __future__ import annotations

import csv
import math
import warnings
from io import StringIO
from pathlib import Path
from typing import Any

import optuna
from rich.console import Console
from rich.table import Table

from tianji.config import apply_overrides, build_config, to_yaml
from tianji.tools.sweep.objective import Objective
from tianji.tools.sweep.space import Param, override

SUMMARY_COLUMNS = (
    "target_reached",
    "time_to_target_s",
    "final_return_mean100",
    "env_steps",
    "wall_time_s",
    "stop_reason",
    "note",
    "run_dir",
)
STATE_ORDER = {"COMPLETE": 0, "PRUNED": 1, "FAIL": 2, "RUNNING": 3, "WAITING": 4}


def _sort_key(trial: optuna.trial.FrozenTrial, objective: Objective) -> tuple[int, float]:
    """Complete trials by value, then pruned ones by their last report, then the rest; best first."""
    value = trial.value
    if value is None and trial.intermediate_values:
        value = trial.intermediate_values[max(trial.intermediate_values)]
    sign = 1.0 if objective.direction == "minimize" else -1.0
    return STATE_ORDER.get(trial.state.name, 5), sign * value if value is not None else math.inf


def trial_rows(study: optuna.Study, params: list[Param], objective: Objective) -> list[dict[str, Any]]:
    """One row per trial, sorted best first: number, state, value, each parameter, and the run's numbers."""
    rows = []
    for t in sorted(study.trials, key=lambda t: _sort_key(t, objective)):
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name, objective.name: t.value}
        for p in params:
            row[p.key] = p.value(t.params[p.key]) if p.key in t.params else None
        row.update({key: t.user_attrs.get(key) for key in SUMMARY_COLUMNS})
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return study.best_trial if complete else None


def best_config_text(
    base_raw: dict[str, Any], params: list[Param], trial: optuna.trial.FrozenTrial, objective: Objective
) -> str:
    """best.yaml: the sweep's base config with the best trial's values, resolved (`tianji train best.yaml`)."""
    values = {p.key: p.value(trial.params[p.key]) for p in params if p.key in trial.params}
    cfg = build_config(apply_overrides(base_raw, [override(k, v) for k, v in values.items()]))
    chosen = ", ".join(f"{k}={v!r}" for k, v in values.items())
    header = (
        f"# best trial of the sweep: #{trial.number}, {objective.name} {trial.value:.4g} "
        f"({objective.direction}); run {trial.user_attrs.get('run_dir')}\n# {chosen}\n"
    )
    return header + to_yaml(cfg)


def format_table(rows: list[dict[str, Any]], limit: int = 30) -> str:
    """The trials as a text table, best first (rich, as `tianji train` prints its summary)."""
    table = Table(title="sweep trials, best first")
    columns = [c for c in (rows[0] if rows else {}) if c not in ("run_dir", "final_return_mean100")]
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows[:limit]:
        table.add_row(*(_cell(row[c]) for c in columns))
    out = StringIO()
    Console(file=out, width=200).print(table)
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_plots(sweep_dir: Path, study: optuna.Study) -> list[str]:
    """history.png and importance.png; returns what could not be drawn, and why (too few trials)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    missing = []
    for name, draw in (
        ("history.png", optuna_plots.plot_optimization_history),
        ("importance.png", optuna_plots.plot_param_importances),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = draw(study)
            figure = axes.get_figure(root=True)
            if figure is None:
                continue
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(sweep_dir / name, dpi=100)
            plt.close(figure)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            missing.append(f"{name}: {exc}")
    return missing


def write_outputs(
    sweep_dir: Path,
    study: optuna.Study,
    params: list[Param],
    objective: Objective,
    base_raw: dict[str, Any],
    plots: bool,
    console: Any = None,
) -> None:
    write_csv(sweep_dir / "sweep.csv", trial_rows(study, params, objective))
    best = best_trial(study)
    if best is not None:
        tmp = sweep_dir / "best.yaml.tmp"
        tmp.write_text(best_config_text(base_raw, params, best, objective))
        tmp.replace(sweep_dir / "best.yaml")
    if plots and study.trials:
        for reason in write_plots(sweep_dir, study):
            if console is not None:
                console.event(f"no {reason}")
