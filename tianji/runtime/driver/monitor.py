"""Driver-side metrics: aggregates role events, checks stop conditions, writes the run directory.

Roles send small dict events with *deltas* since their last event:

    {"kind": "actor", "id": 0, "env_steps": 512, "episodes": [[500.0, 500]], "busy_s": 0.09, "wait_s": 0.0}
    {"kind": "learner", "version": 7, "updates": 1, "samples_trained": 2048, "lags": [0, 1],
     "dropped": 0, "busy_s": 0.05, "wait_s": 0.04, "stats": {"policy_loss": ...}, "bad_messages": 0}

The monitor turns them into rows with fixed prefixes (`env/`, `perf/`, `balance/`,
`train/`) written to metrics.csv, metrics.jsonl and TensorBoard, and a console line.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from tianji.config import Config
from tianji.runtime.balance import lag_summary

WINDOW = 100


class Monitor:
    def __init__(self, cfg: Config, run_dir: Path, t0: float, resumed: dict[str, Any] | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.t0 = t0
        r = resumed or {}
        self.elapsed_before = float(r.get("wall_time_s", 0.0))
        self.env_steps = int(r.get("env_steps", 0))
        self.episodes = int(r.get("episodes", 0))
        self.returns: deque[float] = deque(r.get("returns", []), maxlen=WINDOW)
        self.lengths: deque[int] = deque(r.get("lengths", []), maxlen=WINDOW)
        self.wins: deque[bool] = deque(r.get("wins", []), maxlen=WINDOW)  # envs that report wins (SMAX)
        self.lag_hist: Counter = Counter({int(k): v for k, v in r.get("lag_hist", {}).items()})  # trained
        self.dropped_lag_hist: Counter = Counter({int(k): v for k, v in r.get("dropped_lag_hist", {}).items()})
        self.totals: Counter = Counter(r.get("totals", {}))
        self.target_reached = bool(r.get("target_reached", False))
        self.time_to_target_s = r.get("time_to_target_s")
        self.env_steps_to_target = r.get("env_steps_to_target")
        self.return_at_target = r.get("return_at_target")
        self.version = int(r.get("version", 0))  # of learner 0
        # per learner of a group (rank -> cumulative updates, busy_s, wait_s; lag histogram; version)
        self.learners = int(cfg.topology.learners) if isinstance(cfg.topology.learners, int) else 1
        saved = r.get("learners", {})
        self.per_learner: dict[int, Counter] = {k: Counter(saved.get(str(k), {}).get("totals", {}))
                                                for k in range(self.learners)}
        self.per_learner_lags: dict[int, Counter] = {
            k: Counter({int(lag): n for lag, n in saved.get(str(k), {}).get("lags", {}).items()})
            for k in range(self.learners)}
        self.per_learner_version: dict[int, int] = {k: int(saved.get(str(k), {}).get("version", 0))
                                                    for k in range(self.learners)}
        self._per_learner_window: dict[int, list[int]] = {k: [] for k in range(self.learners)}
        self.eval_return: float | None = r.get("eval_return")
        self.eval_win_rate: float | None = r.get("eval_win_rate")
        self.eval_length = float("nan")
        self.eval_version = -1
        self.replay_ratio = float("nan")
        self.train_stats: dict[str, float] = {}
        self._window_lags: list[int] = []
        self._last_row_time = time.time()
        self._last_counts = self._counts()
        self._per_learner_last: dict[int, Counter] = {}
        self._writer = _RowWriter(run_dir, cfg.logging.tensorboard)
        self._console = _ConsoleLine(cfg.logging.console, show_ratio=cfg.balance.replay_ratio is not None)
        self.last_row: dict[str, float] = {}

    # ------------------------------------------------------------ events
    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "actor":
            self._on_actor(event)
        elif kind == "learner":
            self._on_learner(event)
        elif kind == "eval":
            self._on_eval(event)

    def _on_actor(self, e: dict[str, Any]) -> None:
        self.env_steps += int(e.get("env_steps", 0))
        self.totals["actor_busy_s"] += float(e.get("busy_s", 0.0))
        self.totals["actor_wait_s"] += float(e.get("wait_s", 0.0))
        self.totals["fragments_sent"] += int(e.get("fragments", 0))
        self.totals["bad_messages"] += int(e.get("bad_messages", 0))
        for episode in e.get("episodes", []):
            self.returns.append(float(episode[0]))
            self.lengths.append(int(episode[1]))
            if len(episode) > 2:  # (return, length, won)
                self.wins.append(bool(episode[2]))
            self.episodes += 1
            self._check_target()

    def _on_learner(self, e: dict[str, Any]) -> None:
        rank = e.get("rank", 0)
        if not isinstance(rank, int) or rank not in self.per_learner:
            return
        version = int(e.get("version", self.per_learner_version[rank]))
        self.per_learner_version[rank] = version
        if rank == 0:
            self.version = version
        for key in ("updates", "busy_s", "wait_s"):
            self.per_learner[rank][key] += e.get(key, 0)
        self.per_learner_lags[rank].update(int(x) for x in e.get("lags", []))
        self._per_learner_window[rank].extend(int(x) for x in e.get("lags", []))
        for key in ("updates", "samples_trained", "fragments_consumed", "dropped", "bad_messages", "stale_notices",
                    "refused_peers", "fragments_in_frames", "credits_granted"):
            self.totals[key] += int(e.get(key, 0))
        self.totals["learner_busy_s"] += float(e.get("busy_s", 0.0))
        self.totals["learner_wait_s"] += float(e.get("wait_s", 0.0))
        self.totals["insert_blocked_s"] += float(e.get("insert_blocked_s", 0.0))
        self.totals["sample_blocked_s"] += float(e.get("sample_blocked_s", 0.0))
        self.replay_ratio = float(e.get("replay_ratio", self.replay_ratio))
        lags = [int(x) for x in e.get("lags", [])]
        self.lag_hist.update(lags)
        self._window_lags.extend(lags)
        self.dropped_lag_hist.update(int(x) for x in e.get("dropped_lags", []))
        self.train_stats.update(e.get("stats", {}))

    def _on_eval(self, e: dict[str, Any]) -> None:
        self.eval_return = float(e["return_mean"])
        self.eval_length = float(e.get("length_mean", float("nan")))
        self.eval_version = int(e.get("version", -1))
        if "win_rate" in e:
            self.eval_win_rate = float(e["win_rate"])
        self.totals["eval_rounds"] += 1
        self._check_target()

    def return_mean(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def target_value(self) -> float | None:
        """The number the target is compared with: training mean100 or the latest greedy evaluation."""
        if self.cfg.stop.target_metric == "eval":
            return self.eval_return
        if self.cfg.stop.target_metric == "eval_win_rate":
            return self.eval_win_rate
        return self.return_mean() if len(self.returns) >= WINDOW else None

    def _check_target(self) -> None:
        target, value = self.cfg.stop.target_return, self.target_value()
        if self.target_reached or target is None or value is None:
            return
        if value >= target:
            self.target_reached = True
            self.time_to_target_s = self.elapsed()
            self.env_steps_to_target = self.env_steps
            self.return_at_target = value

    # ------------------------------------------------------------ stop
    def stop_reason(self) -> str | None:
        s = self.cfg.stop
        if s.target_return is not None and self.target_reached:
            return "target_return"
        if s.max_env_steps is not None and self.env_steps >= s.max_env_steps:
            return "max_env_steps"
        if s.max_wall_time_s is not None and self.elapsed() >= s.max_wall_time_s:
            return "max_wall_time_s"
        return None

    # ------------------------------------------------------------ rows
    def _counts(self) -> dict[str, float]:
        return {"env_steps": self.env_steps, **self.totals}

    def tick(self, force: bool = False) -> None:
        """Write a metrics row and refresh the console when the interval has passed."""
        now = time.time()
        dt = now - self._last_row_time
        if not force and dt < self.cfg.logging.interval_s:
            return
        counts = self._counts()
        delta = {k: counts.get(k, 0) - self._last_counts.get(k, 0) for k in counts}
        self._last_counts, self._last_row_time = counts, now
        lags, self._window_lags = self._window_lags, []
        row = self._row(delta, max(dt, 1e-9), lags)
        self.last_row = row
        self._writer.write(row, lags)
        self._console.show(row)

    def _row(self, d: dict[str, float], dt: float, lags: list[int]) -> dict[str, float]:
        actors = self.cfg.topology.actors
        row: dict[str, float] = {
            "time_s": round(self.elapsed(), 3),
            "env_steps": self.env_steps,
            "env/episodes": self.episodes,
            "env/return_mean100": self.return_mean() if self.returns else float("nan"),
            "env/length_mean100": sum(self.lengths) / len(self.lengths) if self.lengths else float("nan"),
            "perf/env_steps_per_s": d.get("env_steps", 0) / dt,
            "perf/updates_per_s": d.get("updates", 0) / dt,
            "perf/samples_trained_per_s": d.get("samples_trained", 0) / dt,
            "perf/actor_busy": d.get("actor_busy_s", 0) / (dt * actors),
            "perf/actor_wait": d.get("actor_wait_s", 0) / (dt * actors),
            "perf/learner_busy": d.get("learner_busy_s", 0) / (dt * self.learners),
            "perf/learner_wait": d.get("learner_wait_s", 0) / (dt * self.learners),
            "balance/policy_version": self.version,
            "balance/lag_min": min(lags) if lags else float("nan"),
            "balance/lag_mean": sum(lags) / len(lags) if lags else float("nan"),
            "balance/lag_max": max(lags) if lags else float("nan"),
            "balance/fragments_dropped": self.totals["dropped"],
            "balance/replay_ratio": self.replay_ratio,
            "balance/insert_blocked": d.get("insert_blocked_s", 0) / dt,
            "balance/sample_blocked": d.get("sample_blocked_s", 0) / dt,
            "eval/return_mean": self.eval_return if self.eval_return is not None else float("nan"),
            "eval/length_mean": self.eval_length,
            "eval/policy_version": self.eval_version,
            "env/win_rate100": sum(self.wins) / len(self.wins) if self.wins else float("nan"),
            "eval/win_rate": self.eval_win_rate if self.eval_win_rate is not None else float("nan"),
            "balance/bad_messages": self.totals["bad_messages"],
        }
        if self.learners > 1:
            row.update(self._per_learner_row(dt))
        row.update({f"train/{k}": v for k, v in self.train_stats.items()})
        return row

    def _per_learner_row(self, dt: float) -> dict[str, float]:
        row: dict[str, float] = {}
        for rank, totals in self.per_learner.items():
            last = self._per_learner_last.get(rank, Counter())
            lags, self._per_learner_window[rank] = self._per_learner_window[rank], []
            row[f"perf/learner{rank}/updates_per_s"] = (totals["updates"] - last["updates"]) / dt
            row[f"perf/learner{rank}/busy"] = (totals["busy_s"] - last["busy_s"]) / dt
            row[f"balance/learner{rank}/lag_mean"] = sum(lags) / len(lags) if lags else float("nan")
            row[f"balance/learner{rank}/policy_version"] = self.per_learner_version[rank]
            self._per_learner_last[rank] = Counter(totals)
        return row

    # ------------------------------------------------------------ summary / state
    def summary(self, stop_reason: str) -> dict[str, Any]:
        mean = self.return_mean()
        metric = {"train": "env/return_mean100 (mean return of the last 100 training episodes)",
                  "eval": f"eval/return_mean (greedy, {self.cfg.eval.episodes} episodes per round)",
                  "eval_win_rate": f"eval/win_rate (greedy, {self.cfg.eval.episodes} episodes per round)"}
        return {
            "target_reached": self.target_reached,
            "target_metric": metric[self.cfg.stop.target_metric],
            "target_return": self.cfg.stop.target_return,
            "time_to_target_s": self.time_to_target_s,
            "env_steps_to_target": self.env_steps_to_target,
            "return_at_target": self.return_at_target,  # the target metric when it was reached
            "final_return_mean100": mean,  # at the end, after the roles stopped
            "final_eval_return_mean": self.eval_return,
            "final_win_rate100": sum(self.wins) / len(self.wins) if self.wins else None,
            "final_eval_win_rate": self.eval_win_rate,
            "eval_rounds": int(self.totals["eval_rounds"]),
            "replay_ratio": None if self.replay_ratio != self.replay_ratio else self.replay_ratio,
            "learner_blocked_s": round(self.totals["sample_blocked_s"], 3),
            "actors_blocked_s": round(self.totals["insert_blocked_s"] + self.totals["actor_wait_s"], 3),
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "wall_time_s": round(self.elapsed(), 3),
            **lag_summary(self.lag_hist),  # of the fragments trained on: never over balance.max_policy_lag
            "policy_lag_histogram": {str(k): v for k, v in sorted(self.lag_hist.items())},
            "credits_granted": int(self.totals["credits_granted"]),  # slots the learners let actors fill
            "fragments_trained": int(self.totals["fragments_consumed"]),
            "fragments_dropped": int(self.totals["dropped"]),
            "dropped_fraction": self.totals["dropped"] / max(1, self.totals["dropped"] + self.totals["fragments_consumed"]),
            "dropped_lag_histogram": {str(k): v for k, v in sorted(self.dropped_lag_hist.items())},
            "bad_messages": int(self.totals["bad_messages"]),
            "stale_notices": int(self.totals["stale_notices"]),
            "refused_peers": int(self.totals["refused_peers"]),
            "fragments_over_network": int(self.totals["fragments_in_frames"]),  # the rest came through shared memory
            "role_restarts": int(self.totals["role_restarts"]),
            "learner_restarts": int(self.totals["learner_restarts"]),
            "updates": int(self.totals["updates"]),
            "samples_trained": int(self.totals["samples_trained"]),
            "policy_version": self.version,
            "learners": {f"learner{rank}": self._learner_summary(rank) for rank in self.per_learner},
            "stop_reason": stop_reason,
        }

    def _learner_summary(self, rank: int) -> dict[str, Any]:
        totals, wall = self.per_learner[rank], max(self.elapsed(), 1e-9)
        return {"updates": int(totals["updates"]), "updates_per_s": round(totals["updates"] / wall, 3),
                "busy": round(totals["busy_s"] / wall, 3), "policy_version": self.per_learner_version[rank],
                **lag_summary(self.per_learner_lags[rank])}

    def state(self) -> dict[str, Any]:
        """What the driver saves beside the learner checkpoint to resume counters."""
        return {
            "wall_time_s": self.elapsed(),
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "wins": list(self.wins),
            "lag_hist": {str(k): v for k, v in self.lag_hist.items()},
            "dropped_lag_hist": {str(k): v for k, v in self.dropped_lag_hist.items()},
            "totals": dict(self.totals),
            "target_reached": self.target_reached,
            "time_to_target_s": self.time_to_target_s,
            "env_steps_to_target": self.env_steps_to_target,
            "return_at_target": self.return_at_target,
            "version": self.version,
            "learners": {str(rank): {"totals": dict(self.per_learner[rank]), "version": self.per_learner_version[rank],
                                     "lags": {str(k): v for k, v in self.per_learner_lags[rank].items()}}
                         for rank in self.per_learner},
            "eval_return": self.eval_return,
            "eval_win_rate": self.eval_win_rate,
        }

    def close(self) -> None:
        self._console.finish()
        self._writer.close()


class _RowWriter:
    """metrics.csv, metrics.jsonl and TensorBoard: every key of every row in all three. A metric that
    first appears after the first row (train/ stats arrive with the first update) widens the CSV:
    the file is rewritten once with the new header, earlier rows empty in the new columns."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.csv_path = run_dir / "metrics.csv"
        self._jsonl = open(run_dir / "metrics.jsonl", "a")
        self._csv_file = None
        self._csv = None
        self.columns: list[str] = _csv_columns(self.csv_path)  # a resumed run appends to its CSV
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=5)

    def write(self, row: dict[str, float], lags: list[int]) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._write_csv(row)
        if self._tb is not None:
            step = int(row["env_steps"])
            for key, value in row.items():
                if key not in ("env_steps",) and value == value:  # skip NaN
                    self._tb.add_scalar(key, value, step)
            if lags:
                self._tb.add_histogram("balance/policy_lag", np.asarray(lags), step)

    def _write_csv(self, row: dict[str, float]) -> None:
        new = [key for key in row if key not in self.columns]
        if new or self._csv is None:
            self._reopen_csv(self.columns + new)
        self._csv.writerow(row)  # type: ignore[union-attr]
        self._csv_file.flush()  # type: ignore[union-attr]

    def _reopen_csv(self, columns: list[str]) -> None:
        """Open the CSV for appending under `columns`, rewriting what it holds when they changed."""
        if self._csv_file is not None:
            self._csv_file.close()
        if columns != self.columns:
            rows = _csv_rows(self.csv_path)
            tmp = self.csv_path.with_suffix(".csv.tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
            tmp.replace(self.csv_path)
            self.columns = columns
        self._csv_file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.columns, extrasaction="ignore")

    def close(self) -> None:
        self._jsonl.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self._tb is not None:
            self._tb.close()


def _csv_columns(path: Path) -> list[str]:
    if not path.exists() or path.stat().st_size == 0:
        return []
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _csv_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class _ConsoleLine:
    """One progress line, rewritten in place on a terminal and appended otherwise."""

    def __init__(self, enabled: bool, show_ratio: bool = False):
        self.enabled = enabled
        self.show_ratio = show_ratio
        self.tty = sys.stdout.isatty()
        self._shown = False

    def show(self, row: dict[str, float]) -> None:
        if not self.enabled:
            return
        ret, evaluated = row["env/return_mean100"], row["eval/return_mean"]
        lag = row["balance/lag_mean"]
        line = (
            f"[{row['time_s']:7.1f}s] steps {int(row['env_steps']):>10,} "
            f"({row['perf/env_steps_per_s'] / 1000:6.1f}k/s) | return {ret:7.1f} "
            + (f"eval {evaluated:6.1f} " if evaluated == evaluated else "")
            + _win_rates(row)
            + f"ep {int(row['env/episodes']):>6} | v{int(row['balance/policy_version'])} "
            f"upd {row['perf/updates_per_s']:5.1f}/s{_per_learner_updates(row)} | lag {_fmt(row['balance/lag_min'])}/"
            f"{_fmt(lag, 1)}/{_fmt(row['balance/lag_max'])} drop {int(row['balance/fragments_dropped'])} | "
            f"busy A {row['perf/actor_busy']:4.0%} L {row['perf/learner_busy']:4.0%}"
        )
        if row["balance/replay_ratio"] == row["balance/replay_ratio"] and self.show_ratio:
            line += f" | rr {row['balance/replay_ratio']:.1f}"
        line += _learning_signs(row)
        if self.tty:
            sys.stdout.write("\r" + line + "\033[K")
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self._shown = True

    def finish(self) -> None:
        if self.enabled and self.tty and self._shown:
            sys.stdout.write("\n")
            sys.stdout.flush()


LEARNING_SIGNS = (("train/entropy", "H", ".2f"), ("train/approx_kl", "kl", ".4f"),
                  ("train/explained_variance", "ev", ".2f"), ("train/grad_norm", "|g|", ".3g"), ("train/lr", "lr", ".2e"),
                  ("train/dead_units", "dead", ".0%"))


def _learning_signs(row: dict[str, float]) -> str:
    """' | H 1.78 kl 0.0021 ev 0.31 |g| 0.42 lr 2.50e-04': is the policy moving? (what the algorithm reports)"""
    parts = [f"{name} {row[key]:{spec}}" for key, name, spec in LEARNING_SIGNS if key in row and row[key] == row[key]]
    return " | " + " ".join(parts) if parts else ""


def _per_learner_updates(row: dict[str, float]) -> str:
    """' (9.8+10.1)': each learner's share of a group's updates/s (nothing for one learner)."""
    shares = [v for k, v in row.items() if k.startswith("perf/learner") and k.endswith("/updates_per_s")]
    return f" ({'+'.join(f'{v:.1f}' for v in shares)})" if len(shares) > 1 else ""


def _win_rates(row: dict[str, float]) -> str:
    """'win 45% eval 60% ' for envs that report wins, nothing otherwise."""
    train, evaluated = row["env/win_rate100"], row["eval/win_rate"]
    return ((f"win {train:4.0%} " if train == train else "")
            + (f"eval win {evaluated:4.0%} " if evaluated == evaluated else ""))


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x != x else f"{x:.{digits}f}"
