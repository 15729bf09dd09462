"""The launchers by name; `train` looks them up here.

reason = LAUNCHERS["local"](run, monitor)   # runs to a stop condition, returns why it stopped
"""

from __future__ import annotations

from collections.abc import Callable

from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.launchers.inline import run_inline
from tianji.runtime.launchers.local import run_local
from tianji.runtime.launchers.ray import run_ray
from tianji.runtime.shared.context import RunContext

Launcher = Callable[[RunContext, Monitor], str]

LAUNCHERS: dict[str, Launcher] = {"local": run_local, "inline": run_inline, "ray": run_ray}
