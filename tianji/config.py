"""Typed run configuration, assembled from the sections each part owns: `env` (tianji.envs.config),
`algo` (each algorithm's module, found through the registry in tianji.algos) and the runtime's
sections below.

Every field carries a description; those descriptions are the CLI help
(`tianji train --help`). Configs are frozen: a run's config never changes after
it is resolved and saved as `config.yaml` in the run directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from tianji.algos import ALGOS
from tianji.envs.config import EnvConfig
from tianji.sections import ConfigError, Section

__all__ = ["AlgoConfig", "Config", "ConfigError", "EnvConfig", "build_config", "load_config"]

if TYPE_CHECKING:  # what the registry holds, spelled out for the type checker (a test keeps the two equal)
    from tianji.algos.appo import APPOConfig
    from tianji.algos.dqn import DQNConfig
    from tianji.algos.impala import IMPALAConfig
    from tianji.algos.mappo import MAPPOConfig
    from tianji.algos.ppo import PPOConfig
    from tianji.algos.qmix import QMIXConfig

    AlgoConfig = PPOConfig | DQNConfig | IMPALAConfig | APPOConfig | QMIXConfig | MAPPOConfig
else:  # the union built from the registry: only typing.Union takes a tuple of types
    AlgoConfig = Annotated[Union[tuple(spec.config for spec in ALGOS.values())], Field(discriminator="name")]  # noqa: UP007


class TopologyConfig(Section):
    learners: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="Learner processes, each with its own actors (assigned evenly), buffer, credits and lag "
        "accounting, kept in step by torch.distributed (see sync.*); auto: chosen by measurement with the actors.",
    )
    actors: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="Actor processes (each runs a vector of envs and its own policy inference); "
        "auto: chosen by measurement at start-up (see `tianji plan`).",
    )
    envs_per_actor: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        16,
        description="Environments stepped together by one actor; auto: chosen by measurement, keeping "
        "envs_per_actor x fragment_length as configured (16 x fragment_length for auto).",
    )
    fragment_length: int = Field(32, ge=1, description="Steps per env in one fragment pushed to the learner.")
    actor_threads: int = Field(1, ge=1, description="torch threads per actor process.")
    learner_threads: int = Field(1, ge=1, description="torch threads in the learner process.")
    actor_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to each actor and evaluator process (local and Ray launchers): when roles "
        "share too few cores, the learner, which every actor waits for, runs first and the actors take the "
        "cycles it leaves (measured on Pong, 2 cores: 1.25x the env steps/s of equal priority); 0: equal.",
    )

    # The runtime reads the layout through these: `auto` is resolved before any role starts
    # (tianji.tools.plan.resolve_layout), so a role never sees it.
    @property
    def actor_count(self) -> int:
        return _resolved(self.actors, "actors")

    @property
    def learner_count(self) -> int:
        return _resolved(self.learners, "learners")

    @property
    def envs_count(self) -> int:
        return _resolved(self.envs_per_actor, "envs_per_actor")


def _resolved(value: int | Literal["auto"], field: str) -> int:
    if isinstance(value, int):
        return value
    raise ConfigError(f"topology.{field} is 'auto' but no layout was planned for it (tianji.tools.plan.resolve_layout)")


class LearnerConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the learner trains: auto picks CUDA when present (pinned host buffers, "
        "non-blocking copies); actors always run on CPU.",
    )


class SyncConfig(Section):
    mode: Literal["allreduce", "average"] = Field(
        "allreduce",
        description="With several learners: allreduce averages gradients at every optimizer step "
        "(identical weights, learners wait for each other); average averages parameters every sync.every updates "
        "with an asynchronous collective while each learner keeps training (the relaxed dependency).",
    )
    every: int = Field(1, ge=1, description="average mode: updates between two parameter averages.")
    average_optimizer: bool = Field(
        True,
        description="average mode: average the Adam moments with the parameters (false: each learner keeps "
        "its own, whose steps then disagree with the averaged parameters; docs/launchers.md).",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="A collective waiting longer than this for a peer fails the "
        "group (a dead learner), which the driver restarts from the last checkpoint.",
    )


AUTO_MAX_INFLIGHT = 4  # the credits per actor `max_policy_lag: auto` may grow to (its shared-memory slots)


class BalanceConfig(Section):
    max_policy_lag: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        8,
        description="Fragments produced more than this many versions ago are dropped (counted). auto: the "
        "bound is moved while the run goes on, from lag_start, by what the learner measures (docs/balance.md).",
    )
    lag_start: int = Field(4, ge=1, description="With max_policy_lag: auto, the bound the run starts from.")
    max_inflight: int = Field(
        2,
        ge=1,
        description="Fragments one actor may have sent but not yet consumed by the learner (credits); with "
        f"max_policy_lag: auto, at least {AUTO_MAX_INFLIGHT}, and the credits granted follow the bound.",
    )
    backpressure: bool = Field(
        True,
        description="Learner takes a fragment only when its buffer has room (on-policy) or the rate limiter "
        "allows (off-policy); false: it takes every fragment at once and queues it (the ablation 'balance off').",
    )
    publish_every: int = Field(1, ge=1, description="Publish weights to actors every N learner updates.")
    publish_delay: int = Field(
        0,
        ge=0,
        description="Diagnosis, not training: actors get the weights of this many updates ago under the current "
        "version. With max_policy_lag 0 the run stays synchronous while its data are as old as at that lag: the "
        "cost of data age alone, apart from asynchrony (benchmarks/pong_staleness.py --variant).",
    )
    publish_delay_varies: bool = Field(
        False,
        description="Diagnosis, with publish_delay: each publish's delay is drawn uniformly from 0 to "
        "publish_delay, so the data's age varies from fragment to fragment as it does asynchronously.",
    )
    refresh_weights: Literal["fragment", "step"] = Field(
        "fragment",
        description="When an actor takes weights the learner has published: before each fragment (a fragment "
        "is one policy version's), or before each env step (fresher data; the fragment keeps the version it "
        "started with, so its lag counts from the oldest weights in it; per-step log-probs keep the "
        "corrections exact).",
    )
    replay_ratio: float | None = Field(
        None,
        gt=0,
        description="Off-policy: samples trained per env step inserted, held by a rate limiter "
        "that pauses the faster side (null: no limit).",
    )
    replay_ratio_tolerance: float = Field(0.1, ge=0, lt=1, description="Allowed relative deviation from replay_ratio.")
    schedule: Literal["free", "deterministic"] = Field(
        "free",
        description="free: a fragment starts from the newest weights and the learner trains fragments as they "
        "arrive (timing decides which fragment meets which weights). deterministic: each learner trains its "
        "actors' fragments in a fixed order (actor i's k-th is number k x actors + i) and fragment n starts from "
        "the weights the learner had after training fragment n - max_policy_lag - 1 (max_policy_lag counts "
        "fragments here): a run is a function of its seed and layout, the same under every launcher, and with "
        "stop.max_env_steps it ends at the same weights (docs/balance.md).",
    )

    @property
    def deterministic(self) -> bool:
        return self.schedule == "deterministic"

    @property
    def lag_is_auto(self) -> bool:
        return self.max_policy_lag == "auto"

    @property
    def bound_at_start(self) -> int:
        """The lag bound the run starts with: the fixed one, or lag_start under auto."""
        return self.lag_start if self.max_policy_lag == "auto" else self.max_policy_lag

    @property
    def slots_per_actor(self) -> int:
        """Each actor's shared-memory slots: max_inflight, or room for what auto may grant."""
        return max(self.max_inflight, AUTO_MAX_INFLIGHT) if self.lag_is_auto else self.max_inflight

    @model_validator(mode="after")
    def _deterministic_needs_a_fixed_schedule(self) -> BalanceConfig:
        if not self.deterministic:
            return self
        if self.lag_is_auto:
            raise ValueError(
                "balance.schedule 'deterministic' fixes the lag: set balance.max_policy_lag to a number "
                "(fragments each one may start ahead of the learner), not 'auto'"
            )
        if self.publish_delay or not self.backpressure:
            raise ValueError(
                "balance.schedule 'deterministic' decides which weights each fragment starts from and when it is "
                "trained: balance.publish_delay must be 0 and balance.backpressure true"
            )
        return self

    @model_validator(mode="after")
    def _varying_delay_needs_a_delay(self) -> BalanceConfig:
        if self.publish_delay_varies and self.publish_delay == 0:
            raise ValueError(
                "balance.publish_delay_varies is true but balance.publish_delay is 0 (the delay's upper end); "
                "set balance.publish_delay"
            )
        return self


class StopConfig(Section):
    target_return: float | None = Field(None, description="Stop when target_metric reaches this return.")
    target_metric: Literal["train", "eval", "eval_win_rate"] = Field(
        "train",
        description="train: mean return of the last 100 training episodes; eval: mean greedy return of "
        "one evaluation round; eval_win_rate: the share of won episodes in one greedy round (SMAX; target_return "
        "is then a rate in [0, 1]); both need eval.interval_s.",
    )
    max_env_steps: int | None = Field(None, ge=1, description="Stop after this many env steps in total.")
    max_wall_time_s: float | None = Field(None, gt=0, description="Stop after this many seconds of wall time.")


class EvalConfig(Section):
    interval_s: float | None = Field(
        None,
        gt=0,
        description="Seconds between greedy evaluations of the newest "
        "weights, in their own role (null: no evaluation).",
    )
    episodes: int = Field(20, ge=1, description="Episodes per evaluation round (run as one vector env).")


class LoggingConfig(Section):
    run_root: str = Field("runs", description="Folder in which run directories are created.")
    console: bool = Field(True, description="Show a live progress line in the terminal.")
    interval_s: float = Field(1.0, gt=0, description="Seconds between metric rows (CSV, TensorBoard, console).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run directory.")


class SupervisionConfig(Section):
    max_actor_restarts: int = Field(
        10,
        ge=0,
        description="Restarts of dead or silent actors and evaluator over the run before it is stopped as failed.",
    )
    max_learner_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of the learner (from the last checkpoint; "
        "actors reconnect) before the run is stopped as failed.",
    )
    heartbeat_timeout_s: float = Field(
        60.0, gt=0, description="A role that sends no event for this long (hung env, deadlock) is killed and replaced."
    )
    driver_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A role that hears nothing from the driver for this long "
        "exits: the driver is gone (killed, OOM, closed session).",
    )


class RayConfig(Section):
    address: str | None = Field(
        None,
        description="Ray cluster to join with --launcher ray: 'auto' (the cluster `ray start --head` made "
        "on this machine), 'HOST:PORT', or null to start a Ray instance for this run only.",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Placement group strategy: PACK fills nodes one after another, SPREAD puts roles on "
        "as many nodes as it can; STRICT_PACK keeps every role on one node (a sweep's trials use it), "
        "STRICT_SPREAD puts each role on a different node.",
    )
    learner_gpus: float = Field(
        0.0, ge=0, description="GPUs in the learner's bundle (the learner then runs where a GPU is free)."
    )
    learner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Extra Ray resources the learner's bundle asks for, e.g. {gpu_node: 1} to "
        "pin it to nodes started with --resources='{\"gpu_node\": 1}'.",
    )
    actor_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources of each actor's bundle."
    )
    evaluator_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources of the evaluator's bundle."
    )
    role_cpus: float | Literal["auto"] = Field(
        "auto",
        description="CPUs each role's bundle asks for per thread. auto: 1 where the cluster has a CPU for every "
        "role thread, else the share that fits the cluster's CPUs (roles then share CPUs, as under the local "
        "launcher). "
        "A number: exactly that (e.g. 0.5 to run two roles per CPU).",
    )
    bind_all_interfaces: bool = Field(
        False,
        description="Listen on every network interface instead of the node's cluster address (only behind "
        "a firewall: every TCP link is CURVE-encrypted and refuses peers without the run's key either way).",
    )
    placement_timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for the cluster to place every role.")
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env for the roles (e.g. {env_vars: {PYTHONPATH: ...}} so "
        "that nodes find your own environment module).",
    )


class CheckpointConfig(Section):
    interval_s: float = Field(
        30.0, gt=0, description="Seconds between periodic checkpoints (one is always written at the end)."
    )
    keep: int = Field(
        3,
        ge=1,
        description="Checkpoint sets kept (each verified by its manifest); a resume takes the newest that verifies.",
    )


class Config(Section):
    name: str = Field("run", description="Run name, the prefix of the run directory.")
    seed: int = Field(
        0, ge=0, description="Seed for envs, networks and sampling; repeatable as far as asynchrony allows."
    )
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment.")
    algo: AlgoConfig = Field(default_factory=ALGOS["ppo"].config, description="Algorithm and its hyperparameters.")
    topology: TopologyConfig = Field(
        default_factory=TopologyConfig, description="Actors, envs per actor, fragment size."
    )
    balance: BalanceConfig = Field(default_factory=BalanceConfig, description="Production-consumption balance.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Keeping several learners in step.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The learner's device.")
    stop: StopConfig = Field(default_factory=StopConfig, description="Stop conditions (any one ends the run).")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Greedy evaluation.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and console output.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    supervision: SupervisionConfig = Field(
        default_factory=SupervisionConfig, description="Role restarts and failure detection."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray launcher (--launcher ray).")

    @model_validator(mode="after")
    def _lr_horizon_from_stop(self) -> Config:
        """A linear schedule without its own horizon ends at stop.max_env_steps (resolved here, so that
        config.yaml shows it)."""
        if self.algo.lr_schedule == "linear" and self.algo.lr_horizon is None:
            if self.stop.max_env_steps is None:
                raise ValueError(
                    "algo.lr_schedule is 'linear' but neither algo.lr_horizon nor stop.max_env_steps "
                    "is set; set one of them"
                )
            object.__setattr__(self, "algo", self.algo.model_copy(update={"lr_horizon": self.stop.max_env_steps}))
        return self

    @model_validator(mode="after")
    def _eval_target_needs_eval(self) -> Config:
        if self.stop.target_metric != "train" and self.stop.target_return is not None and self.eval.interval_s is None:
            raise ValueError(
                f"stop.target_metric is {self.stop.target_metric!r} but eval.interval_s is null; set eval.interval_s"
            )
        t = self.topology
        if isinstance(t.learners, int) and isinstance(t.actors, int) and t.learners > t.actors:
            raise ValueError(
                f"topology.learners is {t.learners} but there are {t.actors} actors; every learner "
                "needs at least one actor of its own"
            )
        if self.algo.lr_schedule == "kl" and isinstance(t.learners, int) and t.learners > 1:
            raise ValueError(
                "algo.lr_schedule 'kl' adapts each learner's rate to its own batches, which would pull a "
                f"group of {t.learners} learners apart; use topology.learners 1 or a 'linear' schedule"
            )
        return self


# ---------------------------------------------------------------- loading

PRESET_PACKAGE = "tianji.presets"


def preset_names() -> list[str]:
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config sections, got {type(data).__name__}")
    return data


def load_raw(preset_or_path: str) -> dict[str, Any]:
    """Read a preset name or a YAML file path into a plain dict."""
    path = Path(preset_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file not found: {preset_or_path}")
        return _read_yaml(path.read_text(), str(path))
    if preset_or_path not in preset_names():
        raise ConfigError(
            f"unknown preset '{preset_or_path}'; presets: {', '.join(preset_names())} (or give a .yaml path)"
        )
    text = resources.files(PRESET_PACKAGE).joinpath(f"{preset_or_path}.yaml").read_text()
    return _read_yaml(text, f"preset {preset_or_path}")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides; values are parsed as YAML scalars or lists."""
    raw = _deep_copy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _format_validation_error(exc: ValidationError) -> str:
    messages: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = list(err["loc"])
        if len(loc) > 2 and loc[0] == "algo":  # drop the discriminator tag pydantic inserts
            del loc[1]
        # union members show up as tags such as "constrained-int" or "literal['auto']": not field names
        path = ".".join(str(p) for p in loc if isinstance(p, int) or str(p).isidentifier())
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "value_error":  # our own cross-field checks name their fields
            msg = msg.removeprefix("Value error, ")
        messages.setdefault(path, [])
        if msg not in messages[path]:
            messages[path].append(msg)
        if "input" in err and err["type"] not in ("missing", "value_error", "extra_forbidden"):
            given = f"(got {err['input']!r})"
            messages[path] = [m for m in messages[path] if m != given] + [given]
    lines: list[str] = []
    for path, msgs in messages.items():
        got = [m for m in msgs if m.startswith("(got ")]
        text = " or ".join(m for m in msgs if not m.startswith("(got ")) + (f" {got[0]}" if got else "")
        lines.append(f"  {path}: {text}" if path else f"  {text}")
    return "invalid config:\n" + "\n".join(lines)


def build_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def load_config(preset_or_path: str, overrides: list[str] | None = None) -> Config:
    return build_config(apply_overrides(load_raw(preset_or_path), overrides or []))


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key.path, default, description) for every leaf field; this is the CLI help."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        sections = _section_types(field.annotation)
        for section in sections:
            tag = section.model_fields.get("name")
            sub_rows = describe_fields(section, f"{prefix}{name}.")
            if len(sections) > 1 and tag is not None:  # algorithm sections: say which algorithm a field is for
                sub_rows = [(k, d, f"[{tag.default}] {doc}") for k, d, doc in sub_rows]
            rows.extend(sub_rows)
        if not sections:
            default = field.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", None) or ():  # Annotated[Union[...]] of algorithm configs
        found.extend(t for t in _section_types(arg) if t not in found)
    return found
