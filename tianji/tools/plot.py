"""`tianji plot RUN_DIR [RUN_DIR ...]`: learning curves (needs matplotlib).

One run: RUN_DIR/curve.png with its return against env steps and wall time, and its policy lag.
Several runs: one picture that overlays them, return against wall time and against env steps, one
colour per run (solid: mean of the last 100 training episodes; dashed: greedy evaluation), the
legend from the run directories' names, so two settings can be compared side by side.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) not in (None, "", "nan") else float("nan") for r in rows]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("tianji plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a TianJi run directory?")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise FileNotFoundError(f"{path} has no rows yet")
    return rows


def _has(rows: list[dict[str, str]], key: str) -> bool:
    return any(value == value for value in _column(rows, key))


def plot_run(run_dir: Path) -> Path:
    plt = _pyplot()
    rows = read_metrics(run_dir)
    steps, seconds = _column(rows, "env_steps"), _column(rows, "time_s")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, x, label in ((axes[0], steps, "env steps"), (axes[1], seconds, "wall time (s)")):
        ax.plot(x, _column(rows, "env/return_mean100"), label="training return (mean of 100)")
        if _has(rows, "eval/return_mean"):
            ax.plot(x, _column(rows, "eval/return_mean"), label="greedy evaluation return")
        ax.set_xlabel(label)
        ax.set_ylabel("return")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(seconds, _column(rows, "balance/lag_mean"), label="mean")
    axes[2].plot(seconds, _column(rows, "balance/lag_max"), label="max")
    axes[2].set_xlabel("wall time (s)")
    axes[2].set_ylabel("policy lag (versions)")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_runs(run_dirs: list[Path], out: Path, title: str | None = None) -> Path:
    """Overlay several runs in one PNG: return against wall time (left) and env steps (right)."""
    plt = _pyplot()
    fig = overlay(run_dirs, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def overlay(run_dirs: list[Path], title: str | None = None) -> Any:
    """The figure of `plot_runs` (two axes, one line per run and metric)."""
    plt = _pyplot()
    runs = [(run_dir, read_metrics(run_dir)) for run_dir in run_dirs]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (run_dir, rows) in enumerate(runs):
        colour = colours[i % len(colours)]
        for ax, key in ((axes[0], "time_s"), (axes[1], "env_steps")):
            x = _column(rows, key)
            ax.plot(x, _column(rows, "env/return_mean100"), color=colour, label=run_dir.name)
            if _has(rows, "eval/return_mean"):
                ax.plot(
                    x,
                    _column(rows, "eval/return_mean"),
                    color=colour,
                    linestyle="--",
                    label=f"{run_dir.name} (greedy eval)",
                )
    for ax, label in ((axes[0], "wall time (s)"), (axes[1], "env steps")):
        ax.set_xlabel(label)
        ax.set_ylabel("return (mean of the last 100 training episodes)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
