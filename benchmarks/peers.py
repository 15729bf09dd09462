"""TianJi against RLlib and Stable-Baselines3 on one machine: time to the same target, side by side.

    pip install -e '.[peers]'           # ray[rllib], stable-baselines3, rl-zoo3 (its published hyperparameters)
    python benchmarks/peers.py [--tasks cartpole-ppo cartpole-dqn acrobot-ppo pong-ppo pong-appo] [--seeds 10]
                               [--pong-seeds 1] [--rllib-seeds N] [--cap-s 300] [--pong-minutes 30]
                               [--out benchmarks/results/peers]

Runs interleave (TianJi, RLlib, SB3, TianJi, ...), one at a time, each a fresh command timed from its start
(imports included) to the target or the cap; a run that misses the cap counts as the cap and is marked
">". Each peer uses its own published tuned settings (RLlib's tuned examples, rl-zoo's hyperparameter files;
`benchmarks/peers_run.py` says which) with as many env runners as the machine has cores. Targets:

- cartpole-ppo: 100-episode mean training return >= 475;
- cartpole-dqn: greedy evaluation mean (20 episodes) >= 475;
- acrobot-ppo: 100-episode mean >= -100;
- pong-ppo, pong-appo: score and env steps at the cap, and the time to the first of -15, 0, 12 and 18 each
  reaches (Stable-Baselines3 has no APPO).

Runs finished in an earlier sitting (same --work) are read, not run again, so a sitting can be split:
the CartPole and Acrobot rows one day, Pong another, then the whole table from one invocation. A longer
TianJi run of the same preset and seed linked there as `tianji-TASK-sSEED` (a zoo run, 60 minutes) is read
up to the cap from its metrics; the table names such rows.

Writes a table (median wall time and spread, the slowest seed, env steps, env steps/s, each peer's time over
TianJi's on the median and on the slowest seed) with the machine and every system's version to OUT.md and
OUT.json. CartPole and Acrobot run 10 seeds by default: a preset whose env steps to its target vary 1.7x
across seeds needs more than three to tell its median, and its slowest seed is what a user may meet.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import train_command, update_page_tables

HERE = Path(__file__).parent
TIANJI_PRESETS = {
    "cartpole-ppo": "cartpole-ppo",
    "cartpole-dqn": "cartpole-dqn",
    "acrobot-ppo": "acrobot-ppo",
    "pong-ppo": "pong-ppo",
    "pong-appo": "pong-appo",
}
TARGETS = {
    "cartpole-ppo": ("mean100", 475.0),
    "cartpole-dqn": ("greedy eval of 20", 475.0),
    "acrobot-ppo": ("mean100", -100.0),
    "pong-ppo": ("mean100", 18.0),
    "pong-appo": ("mean100", 18.0),
}
UNSUPPORTED = {("pong-appo", "sb3"): "Stable-Baselines3 has no APPO"}
PONG_THRESHOLDS = (-15.0, 0.0, 12.0, 18.0)
PAPER = {"RLlib (PPO)": 4.36, "XingTian (PPO)": 2.95, "best": 4.37}  # the paper's headline: peer time / TianJi's


def run_tianji(task: str, seed: int, cap_s: float, work: Path) -> dict[str, Any]:
    run_dir = work / f"tianji-{task}-s{seed}"
    settings = [f"seed={seed}", f"stop.max_wall_time_s={cap_s}", "checkpoint.interval_s=600"]
    if is_pong(task):
        settings += ["stop.target_return=18", "logging.interval_s=10"]
    if not finished(run_dir, cap_s):
        command = train_command(TIANJI_PRESETS[task], run_dir, *settings)
        with open(run_dir.with_suffix(".log"), "w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return judge_at_cap(run_dir, task, cap_s)


def judge_at_cap(run_dir: Path, task: str, cap_s: float) -> dict[str, Any]:
    """A TianJi run as the cap saw it. A run that went on past the cap (one of the zoo's 60-minute Pong runs of
    the same preset and seed, linked into --work) is read up to the cap from its metrics, as if cut there."""
    summary = json.loads((run_dir / "summary.json").read_text())
    points = [p for p in tianji_points(run_dir, task) if p[0] <= cap_s]
    reached = bool(summary["target_reached"]) and summary["time_to_target_s"] <= cap_s
    longer = summary["wall_time_s"] > cap_s
    if reached:
        seconds, env_steps = summary["time_to_target_s"], summary["env_steps_to_target"]
    elif longer:
        seconds, env_steps = cap_s, (points[-1][1] if points else 0)
    else:
        seconds, env_steps = summary["wall_time_s"], summary["env_steps"]
    result = {
        "reached": reached,
        "seconds": seconds,
        "env_steps": env_steps,
        "final": points[-1][2] if points else None,
        "thresholds": thresholds_of(points),
        "points": points,
    }
    if longer:
        result["read_at_cap_from"] = f"a {summary['wall_time_s'] / 60:.0f}-minute run"
    return result


def finished(run_dir: Path, cap_s: float) -> bool:
    """A TianJi run of an earlier sitting that ended by itself (target or cap), not by an interruption, or
    that ran at least as long as the cap (then it is read at the cap)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return False
    summary = json.loads(path.read_text())
    return summary.get("stop_reason") != "interrupted" or summary.get("wall_time_s", 0.0) >= cap_s


def is_pong(task: str) -> bool:
    return task.startswith("pong")


def tianji_points(run_dir: Path, task: str) -> list[tuple[float, int, float]]:
    key = "eval/return_mean" if task == "cartpole-dqn" else "env/return_mean100"
    with open(run_dir / "metrics.csv", newline="") as f:
        return [
            (float(r["time_s"]), int(float(r["env_steps"])), float(r[key]))
            for r in csv.DictReader(f)
            if r.get(key) not in (None, "", "nan")
        ]


def thresholds_of(points: list[tuple[float, int, float]]) -> dict[str, tuple[float, int]]:
    out: dict[str, tuple[float, int]] = {}
    for threshold in PONG_THRESHOLDS:
        hit = next(((t, s) for t, s, v in points if v >= threshold), None)
        if hit is not None:
            out[str(threshold)] = hit
    return out


def run_peer(system: str, task: str, seed: int, cap_s: float, work: Path) -> dict[str, Any]:
    out = work / f"{system}-{task}-s{seed}.json"
    command = [
        sys.executable,
        str(HERE / "peers_run.py"),
        "--system",
        system,
        "--task",
        task,
        "--seed",
        str(seed),
        "--cap-s",
        str(cap_s),
        "--out",
        str(out),
    ]
    if out.exists():  # finished in an earlier sitting (peers_run.py writes it only at the end)
        return load_peer_result(out, cap_s)
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=cap_s + 600)
    if done.returncode != 0 or not out.exists():
        return {
            "reached": False,
            "seconds": cap_s,
            "env_steps": 0,
            "final": None,
            "thresholds": {},
            "points": [],
            "error": f"exit code {done.returncode}; see {out.with_suffix('.log')}",
        }
    return load_peer_result(out, cap_s)


def load_peer_result(path: Path, cap_s: float) -> dict[str, Any]:
    result = json.loads(path.read_text())
    result["thresholds"] = {k: tuple(v) for k, v in result["thresholds"].items()}
    if not result["reached"]:  # a miss counts as the cap (a peer checks its clock only between iterations)
        result["seconds"] = cap_s
    return result


def machine() -> dict[str, Any]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = int(Path("/proc/meminfo").read_text().split()[1]) // (1024 * 1024)
    versions = {}
    for package in ("tianji", "torch", "gymnasium", "ale-py", "ray", "stable-baselines3", "rl-zoo3"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
    }


def summarise(task: str, system: str, runs: list[dict[str, Any]], cap_s: float) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    reached = [r for r in runs if r["reached"]]
    rates = [r["env_steps"] / r["seconds"] for r in runs if r["seconds"] > 0 and r["env_steps"]]
    row = {
        "task": task,
        "system": system,
        "runs": len(runs),
        "reached": len(reached),
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "slowest_seed": seconds.index(max(seconds)),
        "median_env_steps": statistics.median(r["env_steps"] for r in runs),
        "env_steps_per_s": statistics.median(rates) if rates else None,
        "capped": len(reached) < len(runs),
        "cap_s": cap_s,
        "final": statistics.median(r["final"] for r in runs if r["final"] is not None)
        if any(r["final"] is not None for r in runs)
        else None,
        "errors": [r["error"] for r in runs if "error" in r],
        "read_at_cap": [r["read_at_cap_from"] for r in runs if "read_at_cap_from" in r],
        "notes": sorted({r["note"] for r in runs if r.get("note")}),
    }
    if is_pong(task):
        row["thresholds"] = {str(t): [r["thresholds"].get(str(t)) for r in runs] for t in PONG_THRESHOLDS}
    return row


def table(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    def time_cell(row: dict[str, Any]) -> str:
        mark = ">" if row["reached"] == 0 else ""
        digits = 1 if row["max_s"] < 10 else 0  # a few seconds' spread would round to one number
        spread = f" ({row['min_s']:.{digits}f}-{row['max_s']:.{digits}f})" if row["runs"] > 1 else ""
        return f"{mark}{row['median_s']:.1f} s{spread}, {row['reached']}/{row['runs']} reached"

    tianji = {r["task"]: r for r in rows if r["system"] == "tianji"}
    v = info["versions"]
    lines = [
        "# TianJi, RLlib and Stable-Baselines3, side by side",
        "",
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; Python {info['python']}; "
        f"TianJi {v['tianji']}, torch {v['torch']}, Gymnasium {v['gymnasium']}, ale-py {v['ale-py']}, "
        f"Ray RLlib {v['ray']}, Stable-Baselines3 {v['stable-baselines3']} with rl-zoo3 {v['rl-zoo3']}. "
        "Time from each command's start (imports included) to the target; a run that misses its cap counts as "
        "the cap and is marked '>' (then the ratio is a lower bound). Runs one at a time, interleaved within a "
        "sitting; the table joins every sitting's runs in the same work folder (each run's log is there).",
        "",
        *earlier_sittings(rows),
        "| task (target) | system | wall time, median (spread) | slowest seed | env steps (median) | env steps/s "
        "| time / TianJi's: median, slowest seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if is_pong(row["task"]):
            continue
        metric, target = TARGETS[row["task"]]
        base = tianji.get(row["task"])
        rate = f"{row['env_steps_per_s']:,.0f}" if row["env_steps_per_s"] else "-"
        slowest = f"{row['max_s']:.1f} s" + (f" (seed {row['slowest_seed']})" if "slowest_seed" in row else "")
        lines.append(
            f"| {row['task']} ({metric} >= {target:g}) | {row['system']} | {time_cell(row)} | {slowest} | "
            f"{row['median_env_steps'] / 1e3:,.0f}k | {rate} | {ratios_cell(row, base)} |"
        )
    for task in dict.fromkeys(r["task"] for r in rows if is_pong(r["task"])):
        lines += pong_table(task, [r for r in rows if r["task"] == task])
    notes = [f"- {r['task']}, {r['system']}: {note}" for r in rows for note in r.get("notes", [])]
    lines += ["", "Notes on single runs:", "", *notes] if notes else []
    lines += ["", *against_the_best_peer(rows)]
    lines += [
        "",
        f"The paper's claim: TianJi reaches the same score up to {PAPER['best']}x sooner "
        f"({PAPER['RLlib (PPO)']}x RLlib, {PAPER['XingTian (PPO)']}x XingTian on PPO).",
    ]
    return "\n".join(lines) + "\n"


def earlier_sittings(rows: list[dict[str, Any]]) -> list[str]:
    sittings = {row["task"]: row["sitting"] for row in rows if "sitting" in row}
    if not sittings:
        return []
    named = ", ".join(f"{task} ({date})" for task, date in sittings.items())
    return [f"Rows kept from an earlier sitting (its date): {named}.", ""]


def ratios_cell(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """A peer's time over TianJi's, on the medians and on the slowest seeds ('>' where the peer missed its cap)."""
    if row["system"] == "tianji":
        return "1.00, 1.00"
    if base is None:
        return "-"
    missed = ">" if row["reached"] < row["runs"] else ""
    return f"{missed}{row['median_s'] / base['median_s']:.2f}x, {missed}{row['max_s'] / base['max_s']:.2f}x"


def against_the_best_peer(rows: list[dict[str, Any]]) -> list[str]:
    """One line per task: the fastest peer's time over TianJi's (or, on Pong, the scores at the cap), and
    whether that meets the paper's best ratio."""
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        ours = next((r for r in rows if r["task"] == task and r["system"] == "tianji"), None)
        peers = [r for r in rows if r["task"] == task and r["system"] != "tianji"]
        if ours is None or not peers:
            continue
        if is_pong(task):
            best = max(peers, key=lambda r: r["final"] if r["final"] is not None else float("-inf"))
            ahead = ours["final"] is not None and (best["final"] is None or ours["final"] > best["final"])
            lines.append(
                f"- {task}: TianJi's score at the cap {fmt(ours['final'])}, the best peer's ({best['system']}) "
                f"{fmt(best['final'])}: {'ahead' if ahead else 'NOT ahead'}"
            )
            continue
        best = min(peers, key=lambda r: r["median_s"])
        ratio = best["median_s"] / ours["median_s"]
        verdict = "meets" if ratio >= PAPER["best"] and best["reached"] else "below"
        if best["reached"] < best["runs"]:
            verdict = "meets (a lower bound)" if ratio >= PAPER["best"] else "below (a lower bound)"
        lines.append(
            f"- {task}: the fastest peer ({best['system']}) took {ratio:.2f}x TianJi's median time: "
            f"{verdict} the paper's best ratio, {PAPER['best']}x (slowest seeds: {best['max_s'] / ours['max_s']:.2f}x, "
            f"TianJi's {ours['max_s']:.1f} s on seed {ours.get('slowest_seed', '-')} against {best['max_s']:.1f} s)"
        )
    return lines


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def pong_table(task: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"{task} (100-episode mean game score; cap {rows[0]['cap_s'] / 60:.0f} minutes):",
        "",
        "| system | score at the cap (median) | env steps | env steps/s | minutes to -15 / 0 / 12 / 18 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        reached = " / ".join(
            ", ".join(f"{hit[0] / 60:.1f}" if hit else "-" for hit in row["thresholds"][str(t)])
            for t in PONG_THRESHOLDS
        )
        final = f"{row['final']:.1f}" if row["final"] is not None else "-"
        rate = f"{row['env_steps_per_s']:,.0f}" if row["env_steps_per_s"] else "-"
        lines.append(f"| {row['system']} | {final} | {row['median_env_steps'] / 1e6:.2f}M | {rate} | {reached} |")
    lines += [f"| {system} | {why} | | | |" for (t, system), why in UNSUPPORTED.items() if t == task]
    lines += [
        f"\n{row['system']}: read at the cap from {', '.join(row['read_at_cap'])} of the same preset and seed "
        "(an earlier sitting on this machine, its metrics up to the cap)."
        for row in rows
        if row.get("read_at_cap")
    ]
    return lines


def earlier_rows(path: Path, tasks: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows and runs of the tasks this sitting did not run, from the results an earlier sitting wrote there,
    each row marked with that sitting's date: one table grows over sittings (CartPole one day, Pong another)."""
    if not path.exists():
        return [], {}
    earlier = json.loads(path.read_text())
    date = earlier["machine"]["date"]
    rows = [{**row, "sitting": row.get("sitting", date)} for row in earlier["rows"] if row["task"] not in tasks]
    runs = {key: run for key, run in earlier["runs"].items() if key.split("/")[0] not in tasks}
    return rows, runs


def beyond_rllib_seeds(args: argparse.Namespace, task: str, seed: int) -> bool:
    """RLlib's CartPole and Acrobot rows stop at --rllib-seeds (its Pong row follows --pong-seeds)."""
    return not is_pong(task) and args.rllib_seeds is not None and seed >= args.rllib_seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["cartpole-ppo", "cartpole-dqn", "acrobot-ppo", "pong-ppo", "pong-appo"],
        choices=list(TARGETS),
    )
    parser.add_argument("--systems", nargs="+", default=["tianji", "rllib", "sb3"], choices=["tianji", "rllib", "sb3"])
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the CartPole and Acrobot rows")
    parser.add_argument("--pong-seeds", type=int, default=1)
    parser.add_argument(
        "--rllib-seeds",
        type=int,
        default=None,
        help="seeds of RLlib's CartPole and Acrobot rows (default --seeds): 3-60x the others' time, never the fastest",
    )
    parser.add_argument("--cap-s", type=float, default=300.0, help="cap of the CartPole and Acrobot runs")
    parser.add_argument("--pong-minutes", type=float, default=30.0)
    parser.add_argument("--work", default="runs/peers")
    parser.add_argument("--out", default=str(HERE / "results" / "peers"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for task in args.tasks:
        cap = args.pong_minutes * 60 if is_pong(task) else args.cap_s
        for seed in range(args.pong_seeds if is_pong(task) else args.seeds):
            for system in args.systems:  # interleaved: the machine's drift spreads over every system alike
                if (task, system) in UNSUPPORTED or (system == "rllib" and beyond_rllib_seeds(args, task, seed)):
                    continue
                print(f"{task} seed {seed}: {system} ...", flush=True)
                run = (
                    run_tianji(task, seed, cap, work) if system == "tianji" else run_peer(system, task, seed, cap, work)
                )
                results.setdefault((task, system), []).append(run)
                print(
                    f"  {'reached' if run['reached'] else 'missed'} in {run['seconds']:.1f} s, "
                    f"{run['env_steps']:,} env steps, final {run['final']}",
                    flush=True,
                )
    info = machine()
    rows = [
        summarise(task, system, runs, args.pong_minutes * 60 if is_pong(task) else args.cap_s)
        for (task, system), runs in results.items()
    ]
    out = Path(args.out)
    kept_rows, kept_runs = earlier_rows(out.with_suffix(".json"), args.tasks)
    rows = sorted(rows + kept_rows, key=lambda row: list(TARGETS).index(row["task"]))
    runs = {f"{t}/{s}": r for (t, s), r in results.items()} | kept_runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows, "runs": runs}, indent=1))
    out.with_suffix(".md").write_text(table(rows, info))
    print(table(rows, info))
    if out.resolve() == (HERE / "results" / "peers").resolve():  # the pages carry it, untitled
        update_page_tables("peers table", table(rows, info).split("\n", 2)[2])


if __name__ == "__main__":
    main()
