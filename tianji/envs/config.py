"""The `env` section of the config: which environment, built how."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from tianji.sections import Section

DEFAULT_ENV_ID = "CartPole-v1"


class EnvConfig(Section):
    id: str | None = Field(
        None,
        description="Gymnasium environment id (CartPole-v1), or 'module:EnvId' for your own environment: the "
        "module is imported first (in every process) so that its gymnasium.register calls run; 'ALE/Pong-v5' "
        "for Atari; 'smax:3m' (any SMAX map) or 'pettingzoo:mpe2.simple_spread_v3' (a PettingZoo parallel env "
        "module) for cooperative multi-agent training. "
        f"Default {DEFAULT_ENV_ID} unless env.entry_point is set.",
    )
    entry_point: str | None = Field(
        None,
        description="'package.module:factory': a class or function returning a gymnasium.Env, called with "
        "env.kwargs; for environments that are not registered. Set this or env.id, not both.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for gymnasium.make "
        "(registered ids), the env.entry_point factory, or ale-py's AtariVectorEnv "
        "(ALE/ ids, e.g. repeat_action_probability: 0.25 for sticky actions).",
    )
    crop: tuple[int, int, int, int] | None = Field(
        None,
        description="ALE/ ids: [top, bottom, left, right], the rows and columns of each (resized) frame to "
        "keep, e.g. Pong's playfield without the score at 84x84: [14, 78, 0, 84] (null: the whole frame).",
    )
    pool: int = Field(
        1,
        ge=1,
        le=8,
        description="ALE/ ids: max-pool each frame (after the crop) in pool x pool "
        "blocks. It shrinks the frame like a resize, but keeps a thin bright object such as a ball at "
        "full contrast (measured: docs/environments.md).",
    )
    episodic_life: bool = Field(
        False,
        description="ALE/ ids: a lost life ends the value's horizon for training (the learner bootstraps from "
        "zero there, as CleanRL's and the DQN papers' EpisodicLifeEnv does), while the game goes on: nothing "
        "is reset, and episode returns, the stop target and evaluation stay whole games.",
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="Clip rewards to [-reward_clip, reward_clip] for training only; returns in the "
        "metrics and the stop target stay the real game score (Atari presets: 1).",
    )

    @field_validator("entry_point")
    @classmethod
    def _module_colon_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
            raise ValueError(f"expected 'package.module:factory', got {value!r}")
        return value

    @field_validator("crop")
    @classmethod
    def _crop_in_order(cls, value: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
        if value is not None:
            top, bottom, left, right = value
            if not (0 <= top < bottom and 0 <= left < right):
                raise ValueError(
                    f"expected [top, bottom, left, right] with 0 <= top < bottom and 0 <= left < right, "
                    f"got {list(value)}"
                )
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("id") is not None and data.get("entry_point") is not None:
                raise ValueError("set env.id or env.entry_point, not both")
            if data.get("id") is None and data.get("entry_point") is None:
                data = {**data, "id": DEFAULT_ENV_ID}
        return data

    @model_validator(mode="after")
    def _frames_of_atari(self) -> EnvConfig:
        if (self.crop is not None or self.pool > 1 or self.episodic_life) and not (self.id or "").startswith("ALE/"):
            raise ValueError(
                f"env.crop, env.pool and env.episodic_life apply to Atari (ALE/ ids), not to {self.describe()}"
            )
        return self

    def describe(self) -> str:
        return f"env.id {self.id!r}" if self.id is not None else f"env.entry_point {self.entry_point!r}"
