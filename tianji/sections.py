"""The base of every config section, and the error bad input raises. The lowest layer: the parts that own
a config section (envs, algorithms) and `tianji.config`, which assembles them, all build on it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what was expected."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
