"""The run's logger, which every role and the driver write to."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tianji")


def log_rejected(role: str, count: int, reason: Any) -> None:
    """Warn about the first rejected messages, then every 1000th: a flood must not flood the log."""
    if count <= 10 or count % 1000 == 0:
        log.warning("%s rejected a message (%d so far): %s", role, count, reason)
