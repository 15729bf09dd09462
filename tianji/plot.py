"""`tianji plot RUN_DIR`: learning curves of a run as curve.png (needs matplotlib)."""

from __future__ import annotations

import csv
from pathlib import Path


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) not in (None, "", "nan") else float("nan") for r in rows]


def plot_run(run_dir: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("tianji plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a TianJi run directory?")
    rows = list(csv.DictReader(open(path, newline="")))
    steps, seconds = _column(rows, "env_steps"), _column(rows, "time_s")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, x, label in ((axes[0], steps, "env steps"), (axes[1], seconds, "wall time (s)")):
        ax.plot(x, _column(rows, "env/return_mean100"), label="training return (mean of 100)")
        if "eval/return_mean" in rows[0]:
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
