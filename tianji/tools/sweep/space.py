"""Search spaces: which config fields a sweep varies and how, checked against the real config.

A space is a YAML mapping from a config field's key path to its distribution, in a file next to
the config (`my.space.yaml` beside `my.yaml`) or given as `--param` options in the same short form:

    algo.lr: {type: loguniform, low: 1.0e-4, high: 3.0e-3}
    algo.entropy_coef: {type: uniform, low: 0.0, high: 0.02}
    algo.epochs: {type: int, low: 2, high: 8}                   # step: 2, log: true also work
    algo.hidden: {type: categorical, choices: [[64, 64], [128, 128]]}
    algo.minibatches: "categorical:2,4,8"                       # the --param form

    --param algo.lr=loguniform:1e-4:3e-3 --param algo.epochs=int:2:8 --param algo.minibatches=categorical:2,4,8
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import optuna
import yaml

from tianji.config import apply_overrides, build_config
from tianji.sections import ConfigError

KINDS = ("loguniform", "uniform", "int", "categorical")
SPACES_PACKAGE = "tianji.presets"  # bundled spaces: tianji/presets/spaces/<preset>.yaml


@dataclass(frozen=True)
class Param:
    """One searched config field. Categorical choices may be lists or mappings (`algo.hidden`); Optuna
    stores those as JSON text, and `value` turns them back into config values."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = field(default_factory=tuple)

    def distribution(self) -> optuna.distributions.BaseDistribution:
        if self.kind == "categorical":
            return optuna.distributions.CategoricalDistribution([_encode(c) for c in self.choices])
        low, high = self.bounds()
        if self.kind == "int":
            return optuna.distributions.IntDistribution(int(low), int(high), log=self.log, step=int(self.step or 1))
        return optuna.distributions.FloatDistribution(low, high, log=self.kind == "loguniform", step=self.step)

    def bounds(self) -> tuple[float, float]:
        """(low, high) of a numeric range (parsing made sure both are set)."""
        assert self.low is not None and self.high is not None, f"{self.key}: a {self.kind} range without bounds"
        return self.low, self.high

    def suggest(self, trial: optuna.Trial) -> Any:
        """Ask the trial for this field's value (an enqueued trial gets its fixed value back)."""
        d = self.distribution()
        if isinstance(d, optuna.distributions.CategoricalDistribution):
            return self.value(trial.suggest_categorical(self.key, d.choices))
        if isinstance(d, optuna.distributions.IntDistribution):
            return trial.suggest_int(self.key, d.low, d.high, step=d.step, log=d.log)
        assert isinstance(d, optuna.distributions.FloatDistribution)
        return trial.suggest_float(self.key, d.low, d.high, step=d.step, log=d.log)

    def value(self, stored: Any) -> Any:
        """The config value for what Optuna stored (decodes JSON-encoded categorical choices)."""
        if self.kind == "categorical":
            encoded = [_encode(c) for c in self.choices]
            return self.choices[encoded.index(stored)] if stored in encoded else stored
        return stored

    def extremes(self) -> list[Any]:
        """Values that must all make a valid config: both bounds, or every choice."""
        if self.kind == "categorical":
            return list(self.choices)
        low, high = self.bounds()
        return [int(low), int(high)] if self.kind == "int" else [low, high]

    def describe(self) -> str:
        if self.kind == "categorical":
            return "categorical " + " | ".join(json.dumps(c) for c in self.choices)
        extra = (f" step {self.step:g}" if self.step else "") + (" log" if self.log and self.kind == "int" else "")
        return f"{self.kind} [{self.low:g}, {self.high:g}]{extra}"

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "categorical":
            return {"type": "categorical", "choices": list(self.choices)}
        spec: dict[str, Any] = {"type": self.kind, "low": self.low, "high": self.high}
        if self.step:
            spec["step"] = self.step
        if self.log and self.kind == "int":
            spec["log"] = True
        return spec


def override(key: str, value: Any) -> str:
    """`--set` text that `tianji train --set` reads back as exactly this value (YAML flow style: PyYAML
    would read JSON's 1e-05 as a string)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
    return f"{key}={text.removesuffix('...').strip()}"


def _encode(choice: Any) -> Any:
    return choice if choice is None or isinstance(choice, (bool, int, float, str)) else json.dumps(choice)


def _number(text: Any, key: str, what: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"search space {key}: {what} must be a number, got {text!r}") from None


def _scalar(text: str) -> Any:
    """A categorical choice from the command line: YAML, with '1e-4' read as a number (YAML 1.1 reads a string)."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_param(text: str) -> Param:
    """`KEY=KIND:ARGS` from `--param`, e.g. algo.lr=loguniform:1e-4:3e-3, algo.epochs=int:2:8[:STEP|:log],
    algo.minibatches=categorical:2,4,8 (or categorical:[[64,64],[128,128]] for list values)."""
    key, sep, spec = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--param {text!r}: expected KEY.PATH=KIND:ARGS, e.g. algo.lr=loguniform:1e-4:3e-3")
    return parse_spec(key.strip(), spec.strip())


def parse_spec(key: str, spec: Any) -> Param:
    """One entry of a space: the short string form or a mapping with `type`."""
    if isinstance(spec, str):
        kind, _, args = spec.partition(":")
        kind = kind.strip()
        if kind == "categorical":
            choices = yaml.safe_load(args) if args.lstrip().startswith("[") else [_scalar(c) for c in args.split(",")]
            return _checked(key, {"type": kind, "choices": choices})
        parts = [a for a in args.split(":") if a != ""]
        log = "log" in parts
        numbers = [p for p in parts if p != "log"]
        if kind not in KINDS or len(numbers) not in (2, 3):
            raise ConfigError(
                f"search space {key}: expected {'|'.join(KINDS)} as KIND:LOW:HIGH[:STEP] "
                f"(categorical:A,B,C), got {spec!r}"
            )
        mapping = {"type": kind, "low": numbers[0], "high": numbers[1], "log": log}
        if len(numbers) == 3:
            mapping["step"] = numbers[2]
        return _checked(key, mapping)
    if isinstance(spec, dict):
        return _checked(key, spec)
    raise ConfigError(
        f"search space {key}: expected a mapping with 'type' or a string like 'loguniform:1e-4:1e-2', got {spec!r}"
    )


def _checked(key: str, spec: dict[str, Any]) -> Param:
    kind = spec.get("type")
    unknown = set(spec) - {"type", "low", "high", "step", "log", "choices"}
    if kind not in KINDS:
        raise ConfigError(f"search space {key}: type must be one of {', '.join(KINDS)}, got {kind!r}")
    if unknown:
        raise ConfigError(
            f"search space {key}: unknown entries {sorted(unknown)} (expected type, low, high, step, log or choices)"
        )
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"search space {key}: categorical needs a non-empty list 'choices', got {choices!r}")
        return Param(key, kind, choices=tuple(choices))
    low, high = _number(spec.get("low"), key, "low"), _number(spec.get("high"), key, "high")
    step = _number(spec["step"], key, "step") if spec.get("step") is not None else None
    if not low < high:
        raise ConfigError(f"search space {key}: low must be below high, got low {low:g}, high {high:g}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"search space {key}: loguniform needs low > 0, got {low:g}")
    if step is not None and step <= 0:
        raise ConfigError(f"search space {key}: step must be positive, got {step:g}")
    log = bool(spec.get("log", False))
    if kind == "int":
        if low != int(low) or high != int(high) or (step is not None and step != int(step)):
            raise ConfigError(f"search space {key}: int needs whole numbers, got low {low:g}, high {high:g}")
        if log and low < 1:
            raise ConfigError(f"search space {key}: int with log needs low >= 1, got {low:g}")
        if log and step not in (None, 1):
            raise ConfigError(f"search space {key}: int with log cannot have a step")
    elif kind == "loguniform" and step is not None:
        raise ConfigError(f"search space {key}: loguniform cannot have a step")
    return Param(key, kind, low, high, step, log)


def parse_space(mapping: Any, source: str) -> list[Param]:
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"{source}: expected a mapping from config keys (algo.lr) to distributions")
    return [parse_spec(str(key), spec) for key, spec in mapping.items()]


def load_space_file(path: Path) -> list[Param]:
    if not path.is_file():
        raise ConfigError(f"--space {path}: no such file")
    try:
        mapping = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--space {path}: not valid YAML: {exc}") from None
    return parse_space(mapping, str(path))


def default_space_source(config: str) -> str | None:
    """The space that goes with a config when none is given: `X.space.yaml` beside `X.yaml`, or the
    bundled space of a preset (tianji/presets/spaces/<preset>.yaml)."""
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        beside = path.with_name(path.name[: -len(path.suffix)] + ".space.yaml")
        return str(beside) if beside.is_file() else None
    bundled = resources.files(SPACES_PACKAGE) / "spaces" / f"{config}.yaml"
    return str(bundled) if bundled.is_file() else None


def resolve_space(config: str, space_file: str | None, params: list[str]) -> list[Param]:
    """--space and --param together (a --param replaces the file's entry for its key), or the default space."""
    source = space_file or (None if params else default_space_source(config))
    found = {p.key: p for p in load_space_file(Path(source))} if source else {}
    found.update({p.key: p for p in map(parse_param, params)})
    if not found:
        raise ConfigError(
            f"sweep {config}: no search space; give --space FILE or --param KEY=KIND:ARGS "
            "(e.g. --param algo.lr=loguniform:1e-4:3e-3)"
        )
    return list(found.values())


def check_space(base: dict[str, Any], space: list[Param]) -> None:
    """Build the config with each parameter at each of its extremes (the others at the base), so that
    an unknown field or a value out of its field's range stops the sweep before any trial starts."""
    for param in space:
        for value in param.extremes():
            try:
                build_config(apply_overrides(base, [override(param.key, value)]))
            except ConfigError as exc:
                detail = str(exc).removeprefix("invalid config:\n").strip()
                raise ConfigError(
                    f"search space {param.key}: the value {value!r} makes an invalid config: {detail}"
                ) from None
