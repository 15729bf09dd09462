"""Whether two runs are the same run (balance.schedule deterministic): what differs between them.

    differences = run_differences(Path("runs/a"), Path("runs/b"))   # [] when they are the same

Compared: the final learner weights byte for byte, every update's training statistics
(`versions.jsonl`), and `summary.json` but for times, rates and how the data travelled. Both runs
must have kept the deterministic schedule to the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tianji.runtime.shared.checkpoint import load_learner

NOT_COMPARED = (  # times and rates differ from run to run; so do the transport's counters
    "wall_time_s",
    "time_to_target_s",
    "learner_blocked_s",
    "actors_blocked_s",
    "fragments_over_network",
    "measured_costs",
    "learners",
)


def comparable_summary(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in NOT_COMPARED and "per_s" not in k}


def run_differences(first: Path, second: Path) -> list[str]:
    """Every way the two runs differ, one line each (empty: the same run)."""
    a, b = comparable_summary(first), comparable_summary(second)
    found = [
        f"{run}: schedule {s.get('schedule')!r}, not deterministic"
        for run, s in ((first, a), (second, b))
        if s.get("schedule") != "deterministic"
    ]
    found += [f"summary {key}: {a.get(key)!r} != {b.get(key)!r}" for key in sorted(a | b) if a.get(key) != b.get(key)]
    versions = [_version_lines(run) for run in (first, second)]
    if not versions[0] or versions[0] != versions[1]:
        found.append(f"versions.jsonl: {len(versions[0])} and {len(versions[1])} lines, not the same")
    weights = [_final_weights(run) for run in (first, second)]
    if weights[0].keys() != weights[1].keys():
        found.append("final weights: different parameters")
    found += [
        f"final weights: {k} differs"
        for k in weights[0]
        if k in weights[1] and not torch.equal(weights[0][k], weights[1][k])
    ]
    return found


def _version_lines(run_dir: Path) -> list[str]:
    path = run_dir / "versions.jsonl"  # written under a deterministic schedule only
    return sorted(path.read_text().splitlines()) if path.exists() else []


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = load_learner(run_dir / "checkpoints")
    if state is None:
        raise FileNotFoundError(f"{run_dir}: no learner checkpoint to compare")
    return dict(state["algo"]["net"])
