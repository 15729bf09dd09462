"""The driver's view of a run: it aggregates the roles' events (tianji.runtime.shared.events), asks
its stop conditions (tianji.runtime.driver.stop) whether the run is over, and hands rows to the
writers (tianji.runtime.driver.writers).

The monitor turns events into rows with fixed prefixes (`env/`, `perf/`, `balance/`,
`train/`) written to metrics.csv, metrics.jsonl and TensorBoard, and a console line.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from tianji.config import Config
from tianji.runtime.balance import lag_summary
from tianji.runtime.driver.ordered import ScheduledEpisodes
from tianji.runtime.driver.stop import StopConditions
from tianji.runtime.driver.writers import ConsoleLine, RowWriter
from tianji.runtime.shared.checkpoint import describe_os_error
from tianji.runtime.shared.events import (
    ACTOR_COUNTERS,
    LEARNER_COUNTERS,
    ActorEvent,
    EvalEvent,
    Event,
    LearnerEvent,
    MeasuredCosts,
)

log = logging.getLogger("tianji")
WINDOW = 100
# the run's totals name some role counters after their role (both sides have busy and wait time)
ACTOR_TOTALS = {"busy_s": "actor_busy_s", "wait_s": "actor_wait_s", "fragments": "fragments_sent"}
LEARNER_TOTALS = {"busy_s": "learner_busy_s", "wait_s": "learner_wait_s"}


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
        self.totals: defaultdict[str, float] = defaultdict(float, r.get("totals", {}))
        self.stop = StopConditions(cfg.stop, r)
        self.version = int(r.get("version", 0))  # of learner 0
        # per learner of a group (rank -> cumulative updates, busy_s, wait_s; lag histogram; version)
        self.learners = cfg.topology.learner_count if isinstance(cfg.topology.learners, int) else 1
        saved = r.get("learners", {})
        self.per_learner: dict[int, defaultdict[str, float]] = {
            k: defaultdict(float, saved.get(str(k), {}).get("totals", {})) for k in range(self.learners)
        }
        self.per_learner_lags: dict[int, Counter] = {
            k: Counter({int(lag): n for lag, n in saved.get(str(k), {}).get("lags", {}).items()})
            for k in range(self.learners)
        }
        self.per_learner_version: dict[int, int] = {
            k: int(saved.get(str(k), {}).get("version", 0)) for k in range(self.learners)
        }
        self._per_learner_window: dict[int, list[int]] = {k: [] for k in range(self.learners)}
        # balance.schedule per learner as it reports it (deterministic ones may fall back to free), and
        # whether it has trained its share of stop.max_env_steps (then the run ends at the same weights)
        self.schedules: dict[int, str] = dict.fromkeys(range(self.learners), cfg.balance.schedule)
        self.schedule_done = dict.fromkeys(range(self.learners), False)
        # deterministic: episodes in the schedule's order, so the training mean and its target are the run's own
        self.ordered = ScheduledEpisodes(cfg.topology.actor_count, WINDOW) if cfg.balance.deterministic else None
        self.measured: dict[str, dict[str, float]] = {}  # role -> costs it measured at start
        self.eval_return: float | None = r.get("eval_return")
        self.eval_win_rate: float | None = r.get("eval_win_rate")
        self.eval_length = float("nan")
        self.eval_version = -1
        self.replay_ratio = float("nan")
        self.lag_bound = self.inflight = float("nan")  # learner 0's, as it last said
        self.train_stats: dict[str, float] = {}
        self._window_lags: list[int] = []
        self._last_row_time = time.time()
        self._last_counts = self._counts()
        self._per_learner_last: dict[int, dict[str, float]] = {}
        self._writer = RowWriter(run_dir, cfg.logging.tensorboard)
        self._console = ConsoleLine(cfg.logging.console, show_ratio=cfg.balance.replay_ratio is not None)
        self.last_row: dict[str, float] = {}
        self._last_write_warning = 0.0

    # ------------------------------------------------------------ events
    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    def count(self, counter: str, n: float = 1) -> float:
        """Add to one of the run's counters (restarts, refused peers, ...); returns its new total."""
        self.totals[counter] += n
        return self.totals[counter]

    def counter(self, counter: str) -> float:
        return self.totals[counter]

    def on_event(self, event: Event) -> None:
        kind = event.get("kind")
        if kind == "actor":
            self._on_actor(cast(ActorEvent, event))
        elif kind == "learner":
            self._on_learner(cast(LearnerEvent, event))
        elif kind == "eval":
            self._on_eval(cast(EvalEvent, event))
        elif kind == "measured":
            costs = cast(MeasuredCosts, event)
            self.measured[costs["role"]] = dict(costs["costs"])

    def _on_actor(self, e: ActorEvent) -> None:
        self.env_steps += int(e.get("env_steps", 0))
        if self.ordered is not None:  # their order in the schedule, whatever order events came in
            settled = self.ordered.report(
                int(e.get("id", 0)),
                int(_number(e, "fragments")),
                int(e.get("env_steps", 0)),
                e.get("episodes", []),
                e.get("episode_fragments", []),
            )
            for mean, env_steps in settled:
                if self._target_in_schedule_order():
                    self.stop.observe(mean, self.elapsed(), env_steps)
        for key in ACTOR_COUNTERS:
            if key != "env_steps":  # counted above
                self.totals[ACTOR_TOTALS.get(key, key)] += _number(e, key)
        for episode in e.get("episodes", []):
            self.returns.append(float(episode[0]))
            self.lengths.append(int(episode[1]))
            if len(episode) > 2:  # (return, length, won)
                self.wins.append(bool(episode[2]))
            self.episodes += 1
            self._check_target()

    def _on_learner(self, e: LearnerEvent) -> None:
        rank = e.get("rank", 0)
        if not isinstance(rank, int) or rank not in self.per_learner:
            return
        version = int(e.get("version", self.per_learner_version[rank]))
        self.per_learner_version[rank] = version
        self.schedules[rank] = str(e.get("schedule", self.schedules[rank]))
        self.schedule_done[rank] = e.get("schedule_done") is True
        self._write_versions(rank, e.get("version_stats", []))
        if rank == 0:
            self.version = version
        for key in ("updates", "busy_s", "wait_s"):
            self.per_learner[rank][key] += _number(e, key)
        self.per_learner_lags[rank].update(int(x) for x in e.get("lags", []))
        self._per_learner_window[rank].extend(int(x) for x in e.get("lags", []))
        for key in LEARNER_COUNTERS:
            self.totals[LEARNER_TOTALS.get(key, key)] += _number(e, key)
        self.replay_ratio = float(e.get("replay_ratio", self.replay_ratio))
        if rank == 0:
            self.lag_bound = _number(e, "lag_bound", self.lag_bound)
            self.inflight = _number(e, "inflight", self.inflight)
        lags = [int(x) for x in e.get("lags", [])]
        self.lag_hist.update(lags)
        self._window_lags.extend(lags)
        self.dropped_lag_hist.update(int(x) for x in e.get("dropped_lags", []))
        self.train_stats.update(e.get("stats", {}))

    def _write_versions(self, rank: int, version_stats: list[Any]) -> None:
        """Under a deterministic schedule: every update's training stats, one JSON line per version."""
        if not version_stats:
            return
        try:
            with (self.run_dir / "versions.jsonl").open("a") as out:
                for version, stats in version_stats:
                    out.write(json.dumps({"learner": rank, "version": version, **stats}) + "\n")
        except OSError as exc:
            log.warning("versions.jsonl not written: %s", exc)

    def _on_eval(self, e: EvalEvent) -> None:
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

    def _target_in_schedule_order(self) -> bool:
        """A training-mean target under a deterministic schedule (kept so far) is judged on the episodes
        in the schedule's order, each counted at the schedule's env steps: the same in every run."""
        return self.ordered is not None and self.cfg.stop.target_metric == "train" and self.schedule == "deterministic"

    def _check_target(self) -> None:
        if not self._target_in_schedule_order():
            self.stop.observe(self.target_value(), self.elapsed(), self.env_steps)

    def stop_reason(self) -> str | None:
        return self.stop.reason(self._steps_toward_stop(), self.elapsed())

    def _steps_toward_stop(self) -> int:
        """The env steps stop.max_env_steps counts: the actors' made, except under a deterministic schedule,
        which ends once every learner has trained its share (its last fragments may still be in training
        when the actors report them made)."""
        budget = self.cfg.stop.max_env_steps
        if budget is None or self.schedule != "deterministic":
            return self.env_steps
        return budget if all(self.schedule_done.values()) else min(self.env_steps, budget - 1)

    @property
    def schedule(self) -> str:
        """balance.schedule as the run kept it: deterministic only while every learner follows one."""
        return "deterministic" if all(s == "deterministic" for s in self.schedules.values()) else "free"

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
        self._write(row, lags)
        self._console.show(row)

    def _write(self, row: dict[str, float], lags: list[int]) -> None:
        """One metrics row to every file; a full disk costs rows (counted, logged once per interval), never the run."""
        try:
            self._writer.write(row, lags)
        except OSError as exc:
            failures = self.count("metrics_write_failures")
            if time.time() - self._last_write_warning >= self.cfg.logging.interval_s:
                log.warning(
                    "metrics row not written: %s; training goes on (%d rows lost so far)",
                    describe_os_error(exc, self.run_dir / "metrics.*"),
                    int(failures),
                )
                self._last_write_warning = time.time()

    def _row(self, d: dict[str, float], dt: float, lags: list[int]) -> dict[str, float]:
        actors = self.cfg.topology.actor_count
        row: dict[str, float] = {
            "time_s": round(self.elapsed(), 3),
            "env_steps": self.env_steps,
            "env/episodes": self.episodes,
            "env/return_mean100": _or_nan(self.return_mean()),
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
            "balance/lag_bound": self.lag_bound,
            "balance/inflight": self.inflight,
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
            last = self._per_learner_last.get(rank, {})
            lags, self._per_learner_window[rank] = self._per_learner_window[rank], []
            row[f"perf/learner{rank}/updates_per_s"] = (totals["updates"] - last.get("updates", 0.0)) / dt
            row[f"perf/learner{rank}/busy"] = (totals["busy_s"] - last.get("busy_s", 0.0)) / dt
            row[f"balance/learner{rank}/lag_mean"] = sum(lags) / len(lags) if lags else float("nan")
            row[f"balance/learner{rank}/policy_version"] = self.per_learner_version[rank]
            self._per_learner_last[rank] = dict(totals)
        return row

    # ------------------------------------------------------------ summary / state
    def summary(self, stop_reason: str) -> dict[str, Any]:
        in_order = self.ordered if self.schedule == "deterministic" else None  # else: the order events came in
        mean = in_order.all_episodes_mean() if in_order is not None else self.return_mean()
        metric = {
            "train": "env/return_mean100 (mean return of the last 100 training episodes)",
            "eval": f"eval/return_mean (greedy, {self.cfg.eval.episodes} episodes per round)",
            "eval_win_rate": f"eval/win_rate (greedy, {self.cfg.eval.episodes} episodes per round)",
        }
        return {
            "target_reached": self.stop.target_reached,
            "target_metric": metric[self.cfg.stop.target_metric],
            "target_return": self.cfg.stop.target_return,
            "time_to_target_s": self.stop.time_to_target_s,
            "env_steps_to_target": self.stop.env_steps_to_target,
            "return_at_target": self.stop.return_at_target,  # the target metric when it was reached
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
            "schedule": self.schedule,  # balance.schedule kept to the end (a deterministic one may fall back)
            "wall_time_s": round(self.elapsed(), 3),
            **lag_summary(self.lag_hist),  # of the fragments trained on: never over balance.max_policy_lag
            "policy_lag_histogram": {str(k): v for k, v in sorted(self.lag_hist.items())},
            "credits_granted": int(self.totals["credits_granted"]),  # slots the learners let actors fill
            "fragments_trained": int(self.totals["fragments_consumed"]),
            "fragments_dropped": int(self.totals["dropped"]),
            "dropped_fraction": self.totals["dropped"]
            / max(1, self.totals["dropped"] + self.totals["fragments_consumed"]),
            "dropped_lag_histogram": {str(k): v for k, v in sorted(self.dropped_lag_hist.items())},
            "bad_messages": int(self.totals["bad_messages"]),
            "stale_notices": int(self.totals["stale_notices"]),
            "fragments_repeated": int(self.totals["fragments_repeated"]),  # refused: none is trained twice
            "refused_peers": int(self.totals["refused_peers"]),
            "fragments_over_network": int(self.totals["fragments_in_frames"]),  # the rest came through shared memory
            "link_resyncs": int(self.totals["link_resyncs"]),  # links that came back after a cut
            "fragments_lost": int(self.totals["fragments_lost"]),  # sent on a cut link, never arrived
            "credits_voided": int(self.totals["credits_voided"]),
            "role_restarts": int(self.totals["role_restarts"]),
            "checkpoint_write_failures": int(self.totals["checkpoint_write_failures"]),  # a full disk, say
            "metrics_write_failures": int(self.totals["metrics_write_failures"]),
            "learner_restarts": int(self.totals["learner_restarts"]),
            "updates": int(self.totals["updates"]),
            "samples_trained": int(self.totals["samples_trained"]),
            "policy_version": self.version,
            "learners": {f"learner{rank}": self._learner_summary(rank) for rank in self.per_learner},
            "measured_costs": self.measured,  # by role: what it measured at start (a learner group's collectives)
            "stop_reason": stop_reason,
        }

    def _learner_summary(self, rank: int) -> dict[str, Any]:
        totals, wall = self.per_learner[rank], max(self.elapsed(), 1e-9)
        return {
            "updates": int(totals["updates"]),
            "updates_per_s": round(totals["updates"] / wall, 3),
            "busy": round(totals["busy_s"] / wall, 3),
            "policy_version": self.per_learner_version[rank],
            **lag_summary(self.per_learner_lags[rank]),
        }

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
            **self.stop.record(),
            "version": self.version,
            "learners": {
                str(rank): {
                    "totals": dict(self.per_learner[rank]),
                    "version": self.per_learner_version[rank],
                    "lags": {str(k): v for k, v in self.per_learner_lags[rank].items()},
                }
                for rank in self.per_learner
            },
            "eval_return": self.eval_return,
            "eval_win_rate": self.eval_win_rate,
        }

    def close(self) -> None:
        self._console.finish()
        try:
            self._writer.close()
        except OSError as exc:  # buffered rows that a full disk refused
            self.count("metrics_write_failures")
            log.warning("metrics files not closed cleanly: %s", describe_os_error(exc))


def _number(event: Mapping[str, object], key: str, default: float = 0.0) -> float:
    """A counter of an event (checked_event made sure every counter is a number); `default` when absent."""
    value = event.get(key, default)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
