"""`tianji train`: resolve the config (and an `auto` layout), make the run directory, launch, summarise."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tianji import __version__
from tianji.algos import get_algo
from tianji.config import Config, ConfigError, build_config, to_yaml
from tianji.envs.make import env_spaces
from tianji.runtime.driver.keeper import CheckpointKeeper
from tianji.runtime.driver.monitor import Monitor
from tianji.runtime.launchers.registry import LAUNCHERS
from tianji.runtime.shared.checkpoint import CheckpointSets, describe_os_error
from tianji.runtime.shared.context import RunContext
from tianji.tools.calibration import available_cores
from tianji.tools.plan import needs_plan, oversubscription_warning, resolve_layout

log = logging.getLogger("tianji")


def new_run_dir(cfg: Config, run_dir: str | None) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.logging.run_root) / f"{cfg.name}-{stamp}"
        n = 1
        while path.exists():
            n += 1
            path = Path(cfg.logging.run_root) / f"{cfg.name}-{stamp}-{n}"
    if (path / "config.yaml").exists():
        raise FileExistsError(f"{path} already holds a run; use --resume {path} to continue it")
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_run_config(run_dir: Path) -> Config:
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.yaml there; is it a TianJi run directory?")
    return build_config(yaml.safe_load(path.read_text()))


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _write_meta(run: RunContext, launcher: str) -> None:
    meta = {
        "tianji_version": __version__,
        "git_revision": _git_revision(),
        "launcher": launcher,
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    name = "meta.json" if not run.resumed else f"meta-resume-{int(time.time())}.json"
    (run.run_dir / name).write_text(json.dumps(meta, indent=2))


def resume_from(run: RunContext) -> dict[str, Any] | None:
    """Verify the run's checkpoints before any role starts: the newest good set's driver counters (a
    damaged newer set is named in one line each); CheckpointError when no set is good."""
    good = CheckpointSets(run.checkpoint_dir).newest_good()
    for line in good.skipped:
        print(f"warning: {line}; resuming from an older set", file=sys.stderr, flush=True)
    if good.skipped:
        print(f"resuming from {good.path.name} (policy version {good.policy_version})", file=sys.stderr, flush=True)
    good.learner_state(0)  # loadable (the learners read it again when they start)
    return good.driver_state()


def check_env_and_algo(cfg: Config) -> None:
    """Fail before anything starts when the env cannot be built or the algorithm cannot take its spaces.
    Builds one env here, so the user's module is imported in the driver as well as in every role."""
    obs_space, act_space = env_spaces(cfg.env)
    try:
        get_algo(cfg.algo.name).check_spaces(obs_space, act_space)
    except ValueError as exc:
        raise ConfigError(f"{cfg.env.describe()}: algo.name {cfg.algo.name!r} cannot train on it: {exc}") from None


def train(
    cfg: Config, launcher: str = "local", run_dir: str | None = None, resume: str | None = None, t0: float | None = None
) -> tuple[Path, dict[str, Any]]:
    """Run training to a stop condition; returns the run directory and its summary."""
    t0 = time.time() if t0 is None else t0
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher: expected one of {tuple(LAUNCHERS)}, got {launcher!r}")
    check_env_and_algo(cfg)
    plan_record = None
    if needs_plan(cfg):  # `auto` layout: measured (or cached for this machine and config) before anything starts
        cfg, plan_record = resolve_layout(cfg)
        chosen = plan_record["chosen"]
        if cfg.logging.console:
            print(
                f"planned layout: {chosen['actors']} actors x {chosen['envs_per_actor']} envs "
                f"({'cached' if plan_record['cached'] else 'measured'}; "
                f"predicted {chosen['env_steps_per_s']:,.0f} env steps/s)",
                flush=True,
            )
        if plan_record["warning"]:
            log.warning(plan_record["warning"])
    elif launcher == "local" and (crowded := oversubscription_warning(cfg, available_cores())):
        log.warning(crowded)
    if resume is not None:
        path = Path(resume)
        run = RunContext(cfg, path, t0, resumed=True)
        resumed_state = resume_from(run)
    else:
        path = new_run_dir(cfg, run_dir)
        (path / "config.yaml").write_text(to_yaml(cfg))
        run = RunContext(cfg, path, t0, resumed=False)
        resumed_state = None
    _write_meta(run, launcher)
    if plan_record is not None:
        (path / "plan.json").write_text(json.dumps(plan_record, indent=2))
    monitor = Monitor(cfg, path, t0, resumed_state)
    if cfg.logging.console:
        print(f"run directory: {path}", flush=True)
    reason = "error"
    try:
        reason = LAUNCHERS[launcher](run, monitor)
        monitor.tick(force=True)
    finally:  # a failed run still leaves its counters and summary behind
        monitor.close()
        CheckpointKeeper(run, monitor).final()
        summary = monitor.summary(reason)
        try:
            (path / "summary.json").write_text(json.dumps(summary, indent=2))
        except OSError as exc:  # a full disk: the summary is still printed and returned
            log.warning("summary.json not written: %s", describe_os_error(exc))
    return path, summary
