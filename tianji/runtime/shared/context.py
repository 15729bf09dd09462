"""What every part of a run is handed: its resolved config, its directory, when it started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tianji.config import Config


@dataclass(frozen=True)
class RunContext:
    cfg: Config
    run_dir: Path
    t0: float  # wall clock at command start; time-to-target counts from here
    resumed: bool

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"
