"""Config fields every algorithm shares: the optimizer, the learning-rate schedule, the network trunk."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tianji.sections import Section


class OptimizerConfig(Section):
    name: Literal["adam", "rmsprop", "rmsprop_tf"] = Field(
        "adam",
        description="adam; rmsprop (not centered) in PyTorch's form: squared-gradient average from 0, eps "
        "added to its root; rmsprop_tf: TensorFlow 1's form, which the IMPALA paper used: the average starts at 1 and "
        "eps is added inside the root (far more damped early on).",
    )
    eps: float = Field(
        1e-8,
        gt=0,
        description="adam, rmsprop: added to the root of the squared-gradient average; "
        "rmsprop_tf: added to the average inside the root. Losses are means over the batch: a "
        "reference that sums its loss over B samples used B times this eps (rmsprop_tf: B^2 times).",
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="adam: decay of the gradient average.")
    beta2: float = Field(0.999, ge=0, lt=1, description="adam: decay of the squared-gradient average.")
    alpha: float = Field(0.99, ge=0, lt=1, description="rmsprop, rmsprop_tf: decay of the squared-gradient average.")
    momentum: float = Field(0.0, ge=0, lt=1, description="rmsprop, rmsprop_tf: momentum.")
    initial_average: float = Field(
        1.0,
        ge=0,
        description="rmsprop_tf: where the squared-gradient average starts "
        "(TensorFlow: 1). For a reference that sums its loss over B samples, 1 / B^2 here.",
    )


class TrainedConfig(Section):
    """Optimisation fields every algorithm shares (name and lr first: each algorithm sets them)."""

    name: str
    lr: float
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    lr_schedule: Literal["constant", "linear", "kl"] = Field(
        "constant",
        description="constant; linear: the learning rate falls linearly to zero over algo.lr_horizon "
        "env steps (consumed by the learners); kl: algo.lr is where it starts, and after every gradient "
        "step it is multiplied by 1.5 when the policy's KL from the update's start is under half of "
        "algo.kl_target, divided by 1.5 when over twice it (rl_games' adaptive schedule), within "
        "[1e-6, 1e-2]. kl: policy-gradient algorithms only.",
    )
    lr_horizon: int | None = Field(
        None, ge=1, description="Env steps over which a linear schedule reaches zero (null: stop.max_env_steps)."
    )
    kl_target: float = Field(
        0.01, gt=0, description="algo.lr_schedule kl: the KL per update the learning rate is steered to."
    )

    measures_kl: ClassVar[bool] = True  # reports approx_kl every gradient step (the kl schedule's input)

    @model_validator(mode="after")
    def _kl_schedule_needs_kl(self) -> TrainedConfig:
        if self.lr_schedule == "kl" and not self.measures_kl:
            raise ValueError(
                f"algo.lr_schedule 'kl' steers by the policy's KL, which {self.name} does not have; "
                "use 'constant' or 'linear'"
            )
        return self


def adam_eps(eps: float) -> Any:
    return Field(default_factory=lambda: OptimizerConfig(eps=eps), description="Optimizer.")


ModelName = Literal["auto", "mlp", "cnn", "cnn_small"]
MODEL_DESCRIPTION = (
    "Network trunk: auto picks cnn for image observations and an MLP of `hidden` layers otherwise; "
    "cnn: the Nature CNN (3 convolutions, 512 units); cnn_small: the IMPALA paper's shallow CNN "
    "(16 and 32 filters, 256 units), cheaper to train on a CPU."
)
INIT_DESCRIPTION = (
    "Initial weights: orthogonal (gain sqrt 2 in the trunk, 0.01 on the policy head, 1 on the value "
    "head; the reference implementations' choice), or default (PyTorch's, last policy layer x0.01)."
)

ConvLayers = list[tuple[int, int, int]]
CONV_DESCRIPTION = (
    "Image trunks: the convolutions as [channels, kernel, stride] each, replacing the model's (cnn: "
    "[[32, 8, 4], [64, 4, 2], [64, 3, 1]]; cnn_small: [[16, 8, 4], [32, 4, 2]]); null: the model's. Small frames "
    "want small strides: a 42x42 frame through cnn_small ends as a 4x4 map, through [[16, 4, 2], [32, 4, 2], "
    "[32, 3, 1]] as 7x7, as fine as the Nature CNN's at 84x84."
)
CONV_FEATURES_DESCRIPTION = "Image trunks: units of the layer after the convolutions (null: the model's, 512 or 256)."


def conv_field() -> Any:
    return Field(None, description=CONV_DESCRIPTION)


def conv_features_field() -> Any:
    return Field(None, ge=1, description=CONV_FEATURES_DESCRIPTION)


# An old `algo` key a release still accepts: its new key, and the new value of each old one (None: the same).
Rename = tuple[str, Mapping[Any, Any] | None]


def accept_renamed(data: Any, renames: Mapping[str, Rename]) -> Any:
    """A config section's raw mapping with each old key in `renames` moved to its new key, and a
    FutureWarning that names both (for a `model_validator(mode="before")`). Both keys at once, or an old
    value with no new counterpart, is an error naming the field."""
    if not isinstance(data, Mapping) or not any(old in data for old in renames):
        return data
    data = dict(data)
    for old, (new, values) in renames.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"algo.{old} is the old name of algo.{new}; set only algo.{new}")
        value = data.pop(old)
        if values is not None:
            if not isinstance(value, (bool, str, int, float)) or value not in values:
                expected = " or ".join(repr(v) for v in values)
                raise ValueError(f"algo.{old} (now algo.{new}) is {value!r}; expected {expected}")
            value = values[value]
        warnings.warn(
            f"algo.{old} is renamed algo.{new} (the old key goes in the next release): write algo.{new}: {value!r}",
            FutureWarning,
            stacklevel=2,
        )
        data[new] = value
    return data
