"""When a run ends: its target reached, or its env-step or wall-time budget spent (any one).

stop = StopConditions(cfg.stop)
stop.observe(value=472.0, elapsed_s=8.1, env_steps=150_000)   # the target metric's newest value
stop.reason(env_steps=150_000, elapsed_s=8.1)                 # None, or why the run stops
"""

from __future__ import annotations

from typing import Any

from tianji.config import StopConfig

RECORD = ("target_reached", "time_to_target_s", "env_steps_to_target", "return_at_target")


class StopConditions:
    def __init__(self, cfg: StopConfig, resumed: dict[str, Any] | None = None):
        self.cfg = cfg
        r = resumed or {}
        self.target_reached = bool(r.get("target_reached", False))
        self.time_to_target_s: float | None = r.get("time_to_target_s")
        self.env_steps_to_target: int | None = r.get("env_steps_to_target")
        self.return_at_target: float | None = r.get("return_at_target")  # the target metric when it was reached

    def observe(self, value: float | None, elapsed_s: float, env_steps: int) -> None:
        """The target metric's newest value (None while it has none); the first to reach the target counts."""
        target = self.cfg.target_return
        if self.target_reached or target is None or value is None or value < target:
            return
        self.target_reached = True
        self.time_to_target_s, self.env_steps_to_target, self.return_at_target = elapsed_s, env_steps, value

    def reason(self, env_steps: int, elapsed_s: float) -> str | None:
        s = self.cfg
        if s.target_return is not None and self.target_reached:
            return "target_return"
        if s.max_env_steps is not None and env_steps >= s.max_env_steps:
            return "max_env_steps"
        if s.max_wall_time_s is not None and elapsed_s >= s.max_wall_time_s:
            return "max_wall_time_s"
        return None

    def record(self) -> dict[str, Any]:
        """For the summary and the driver's checkpoint."""
        return {key: getattr(self, key) for key in RECORD}
