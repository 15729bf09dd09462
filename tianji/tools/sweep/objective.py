"""What a trial is worth: the run's own stop metric, and which way is better.

    objective = Objective.of(cfg, "time_to_target")
    objective.direction                          # "minimize"
    objective.final(summary)                     # time to target, or a penalised value when not reached
    objective.intermediate(row)                  # the same number, as if the run stopped at this metrics row

time_to_target (the default when the config has stop.target_return): seconds from the trial's
command start to the target. A trial that misses the target is worth its wall-time budget times
(1 + shortfall), shortfall = (target - final metric) / max(|target|, 1), at least 0 (1 when no
episode ended): every trial that reached the target ranks above every one that did not, and
among those that did not, the one that came closer ranks higher.
final_return: the stop metric's final value (the 100-episode training mean, or the greedy
evaluation's mean with stop.target_metric: eval); eval_win_rate: the last greedy round's win rate.
Both are maximised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from tianji.config import Config
from tianji.runtime.driver.monitor import WINDOW
from tianji.sections import ConfigError

OBJECTIVES = ("time_to_target", "final_return", "eval_win_rate")
ROW_METRIC = {"train": "env/return_mean100", "eval": "eval/return_mean", "eval_win_rate": "eval/win_rate"}
SUMMARY_METRIC = {
    "train": "final_return_mean100",
    "eval": "final_eval_return_mean",
    "eval_win_rate": "final_eval_win_rate",
}


def _number(value: Any) -> float | None:
    """A finite float, or None (metrics rows write NaN for 'no value yet')."""
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Objective:
    name: str
    target_metric: str  # stop.target_metric: train | eval | eval_win_rate
    target: float | None  # stop.target_return
    budget_s: float | None  # a trial's wall-time budget: the time scale of the penalty

    @staticmethod
    def default_name(cfg: Config) -> str:
        if cfg.stop.target_return is not None:
            return "time_to_target"
        return "eval_win_rate" if cfg.stop.target_metric == "eval_win_rate" else "final_return"

    @classmethod
    def of(cls, cfg: Config, name: str | None = None) -> Objective:
        """The objective for a trial config (its stop section), checked: the config must produce the number."""
        name = name or cls.default_name(cfg)
        if name not in OBJECTIVES:
            raise ConfigError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got {name!r}")
        stop = cfg.stop
        if name == "time_to_target":
            if stop.target_return is None:
                raise ConfigError("--objective time_to_target needs stop.target_return in the config (or --set)")
            if stop.max_wall_time_s is None:
                raise ConfigError(
                    "--objective time_to_target needs a wall-time budget per trial: set "
                    "stop.max_wall_time_s or --trial-seconds (a missed target is penalised by it)"
                )
        if name == "eval_win_rate" and cfg.eval.interval_s is None:
            raise ConfigError("--objective eval_win_rate needs greedy evaluations: set eval.interval_s")
        metric = "eval_win_rate" if name == "eval_win_rate" else stop.target_metric
        return cls(name, metric, stop.target_return, stop.max_wall_time_s)

    @property
    def direction(self) -> Literal["minimize", "maximize"]:
        return "minimize" if self.name == "time_to_target" else "maximize"

    def better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "minimize" else a > b

    def penalised(self, metric: float | None) -> float:
        """A missed target's value: the budget times (1 + shortfall)."""
        assert self.target is not None and self.budget_s is not None
        shortfall = 1.0 if metric is None else max(0.0, (self.target - metric) / max(abs(self.target), 1.0))
        return self.budget_s * (1.0 + shortfall)

    def final(self, summary: dict[str, Any]) -> float | None:
        """The value of a finished trial from its summary.json (None: the run produced no such number)."""
        metric = _number(summary.get(SUMMARY_METRIC[self.target_metric]))
        if self.name != "time_to_target":
            return metric
        if summary.get("target_reached") and _number(summary.get("time_to_target_s")) is not None:
            return float(summary["time_to_target_s"])
        return self.penalised(metric)

    def intermediate(self, row: dict[str, Any]) -> float | None:
        """The value the trial would have if it stopped at this metrics row (what the pruner compares)."""
        metric = _number(row.get(ROW_METRIC[self.target_metric]))
        if self.name != "time_to_target":
            return metric
        if self.reached(row):
            return float(row["time_s"])
        return self.penalised(metric)

    def reached(self, row: dict[str, Any]) -> bool:
        """Whether this metrics row shows the target reached: a time to target is then final, nothing to prune."""
        if self.name != "time_to_target":
            return False
        metric = _number(row.get(ROW_METRIC[self.target_metric]))
        counted = self.target_metric != "train" or (_number(row.get("env/episodes")) or 0) >= WINDOW
        return counted and metric is not None and self.target is not None and metric >= self.target
