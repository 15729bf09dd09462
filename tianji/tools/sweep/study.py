"""The search loop: an Optuna study stored in the sweep directory, trials run as `tianji train`
processes (up to `parallel` at once), their metrics reported to the pruner as they arrive.

    settings = SweepSettings(config="cartpole-ppo", space={"algo.lr": {...}}, objective="time_to_target", trials=20)
    sweep_dir = create_sweep(settings, Path("sweeps/cp"))      # checks the space, writes sweep.json and base.yaml
    outcome = Sweep(sweep_dir).run()                            # "done", "time" or "interrupted"

The sweep directory:
    sweep.json      the settings (what `--resume` continues)
    base.yaml       the resolved config every trial starts from (the user's --set and budgets applied)
    study.journal   the Optuna study (JournalStorage: an append-only file; a crash loses nothing written)
    trials/NNNN/    one ordinary run directory per trial (+ train.log, the trial's output)
    sweep.csv, best.yaml, history.png, importance.png   (tianji.tools.sweep.report)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.storages.journal import JournalFileBackend

from tianji.config import apply_overrides, build_config, load_raw, to_yaml
from tianji.runtime.shared.checkpoint import CheckpointError, CheckpointSets
from tianji.sections import ConfigError
from tianji.tools.plan import resolve_layout
from tianji.tools.sweep.objective import Objective
from tianji.tools.sweep.report import write_outputs
from tianji.tools.sweep.space import Param, check_space, override, parse_space
from tianji.tools.sweep.trial import TrialProcess, train_command

STUDY_NAME = "sweep"
POLL_S = 0.5
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "none")
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


@dataclass
class SweepSettings:
    """Everything a sweep needs to start or continue; saved as sweep.json."""

    config: str  # preset name or YAML path
    space: dict[str, Any]  # config key -> distribution (space.Param.to_dict)
    trials: int
    overrides: list[str] = field(default_factory=list)  # the user's --set, applied to every trial
    objective: str | None = None  # None: from the config (Objective.default_name)
    max_minutes: float | None = None  # no trial starts after this; running ones finish within their budget
    seed: int | None = None
    sampler: str = "tpe"
    pruner: str = "median"
    report_every: str = "5s"  # a report point every N seconds of a trial's wall time ("5s") or N env steps
    grace_s: float = 30.0  # after SIGINT (prune, budget, Ctrl-C), a trial gets this long before SIGKILL
    silent_s: float = 120.0  # a trial that writes no metrics row for this long is hung: stopped, FAIL
    parallel: int = 1
    launcher: str = "local"  # the trials' launcher: local, inline or ray
    address: str | None = None  # with launcher ray: the cluster (ray.address)
    trial_overrides: list[str] = field(default_factory=list)  # what the sweep itself sets on every trial
    cores_per_trial: list[list[int]] = field(default_factory=list)  # with parallel > 1: each slot's cores

    def params(self) -> list[Param]:
        return parse_space(self.space, "sweep.json space")

    def report_unit(self) -> tuple[str, int]:
        """('time_s', seconds) or ('env_steps', steps) between report points."""
        text = self.report_every.strip()
        try:
            unit, every = ("time_s", int(float(text[:-1]))) if text.endswith("s") else ("env_steps", int(float(text)))
        except ValueError:
            raise ConfigError(
                f"--report-every: expected seconds like 5s or env steps like 20000, got {text!r}"
            ) from None
        if every < 1:
            raise ConfigError(f"--report-every: expected a positive interval, got {text!r}")
        return unit, every


def load_settings(sweep_dir: Path) -> SweepSettings:
    path = sweep_dir / "sweep.json"
    if not path.is_file():
        raise FileNotFoundError(f"--resume {sweep_dir}: no sweep.json there; is it a sweep directory?")
    return SweepSettings(**json.loads(path.read_text()))


def save_settings(sweep_dir: Path, settings: SweepSettings) -> None:
    tmp = sweep_dir / "sweep.json.tmp"
    tmp.write_text(json.dumps(asdict(settings), indent=2))
    tmp.replace(sweep_dir / "sweep.json")


def storage(sweep_dir: Path) -> optuna.storages.BaseStorage:
    backend = JournalFileBackend(str(sweep_dir / "study.journal"))
    return optuna.storages.JournalStorage(backend)


def make_sampler(settings: SweepSettings, trials_so_far: int) -> optuna.samplers.BaseSampler:
    # a resumed sweep draws on from another seed: the same seed would propose the first trials again
    seed = None if settings.seed is None else settings.seed + trials_so_far
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: trials running in parallel count as bad guesses, so the next one looks elsewhere
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=5, multivariate=True, constant_liar=settings.parallel > 1
    )


def make_pruner(settings: SweepSettings) -> optuna.pruners.BasePruner:
    _, every = settings.report_unit()
    if settings.pruner == "median":
        # the first point sees a second or two of training after start-up (noise): judged from the second on
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2 * every)
    if settings.pruner == "halving":  # asynchronous successive halving (ASHA), rungs at 2, 6, 18, ... points
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=2 * every, reduction_factor=3)
    return optuna.pruners.NopPruner()


def _check_choices(settings: SweepSettings) -> None:
    for name, value, allowed in (
        ("--sampler", settings.sampler, SAMPLERS),
        ("--pruner", settings.pruner, PRUNERS),
        ("--launcher", settings.launcher, ("local", "inline", "ray")),
    ):
        if value not in allowed:
            raise ConfigError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    if settings.trials < 1 or settings.parallel < 1:
        raise ConfigError("--trials and --parallel: expected positive numbers")
    if settings.max_minutes is not None and settings.max_minutes <= 0:
        raise ConfigError(f"--max-minutes: expected a positive number of minutes, got {settings.max_minutes}")
    if settings.grace_s < 0 or settings.silent_s <= 0:
        raise ConfigError("--grace-s: expected zero or more seconds; --silent-s: expected a positive number")
    settings.report_unit()


def fixed_trial_overrides(settings: SweepSettings, base_raw: dict[str, Any]) -> list[str]:
    """What the sweep sets on every trial: no live console (its output goes to train.log); under Ray, one
    trial's roles on one node (STRICT_PACK) unless the config chose a strategy itself."""
    fixed = ["logging.console=false"]
    if settings.launcher == "ray" and "strategy" not in (base_raw.get("ray") or {}):
        fixed.append("ray.strategy=STRICT_PACK")
    return fixed


def core_slots(parallel: int, cores: list[int]) -> list[list[int]]:
    """Disjoint core sets, one per parallel trial (empty when there is one trial or too few cores)."""
    share = len(cores) // parallel
    if parallel == 1 or share < 1:
        return []
    return [cores[i * share : (i + 1) * share] for i in range(parallel)]


def usable_core_slots(settings: SweepSettings) -> list[list[int]]:
    """The stored core set of each parallel trial, or new ones where this machine (or this process's
    affinity) lacks them: a sweep resumed elsewhere would fail to pin its trials."""
    here = set(os.sched_getaffinity(0))
    if all(set(slot) <= here for slot in settings.cores_per_trial):
        return settings.cores_per_trial
    return core_slots(settings.parallel, sorted(here))


def layout_for_share(base_raw: dict[str, Any], cores: int) -> list[str]:
    """The planner's layout for one trial's share of the cores (`tianji plan --cores N`, measured once for
    the base config: the searched values may move the rates somewhat)."""
    raw = apply_overrides(base_raw, ["topology.actors=auto", "topology.envs_per_actor=auto"])
    planned, record = resolve_layout(build_config(raw), cores=cores)
    t = planned.topology
    print(
        f"layout for a trial on {cores} core(s): {t.actors} actors x {t.envs_per_actor} envs x "
        f"{t.fragment_length} steps ({'cached' if record['cached'] else 'measured'} plan)",
        flush=True,
    )
    return [
        f"topology.actors={t.actors}",
        f"topology.envs_per_actor={t.envs_per_actor}",
        f"topology.fragment_length={t.fragment_length}",
        f"topology.learners={t.learners}",
    ]


def create_sweep(settings: SweepSettings, sweep_dir: Path, plan_layout: bool = True) -> Path:
    """Check everything (space against the config, objective, options), then write the sweep directory
    and its empty study. Nothing starts when a check fails."""
    _check_choices(settings)
    if (sweep_dir / "sweep.json").exists():
        raise FileExistsError(f"{sweep_dir} already holds a sweep; continue it with --resume {sweep_dir}")
    base_raw = apply_overrides(load_raw(settings.config), settings.overrides)
    base = build_config(base_raw)
    params = settings.params()
    check_space(base_raw, params)
    objective = Objective.of(base, settings.objective)
    settings.objective = objective.name
    settings.trial_overrides = fixed_trial_overrides(settings, base_raw)
    if settings.launcher != "ray":
        settings.cores_per_trial = core_slots(settings.parallel, sorted(os.sched_getaffinity(0)))
        if settings.cores_per_trial and plan_layout:
            settings.trial_overrides += layout_for_share(base_raw, len(settings.cores_per_trial[0]))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "base.yaml").write_text(to_yaml(base))
    save_settings(sweep_dir, settings)
    optuna.create_study(study_name=STUDY_NAME, storage=storage(sweep_dir), direction=objective.direction)
    return sweep_dir


@dataclass
class Running:
    """A trial in progress: its Optuna trial, its process and what the sweep decided about it."""

    trial: optuna.Trial
    process: TrialProcess
    slot: int
    next_point: int
    last_row: dict[str, Any] | None = None
    last_row_at: float = field(default_factory=time.time)
    reported: bool = False
    pruned: bool = False
    interrupted: bool = False
    failure: str | None = None  # why the sweep stopped it (hung, over budget)


class Sweep:
    """Runs (or continues) the sweep in `sweep_dir` until it has `settings.trials` finished trials, its time
    is up, or Ctrl-C."""

    def __init__(self, sweep_dir: Path, console: SweepConsole | None = None, process_factory: Any = TrialProcess):
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints its own lines for each trial
        self.dir = sweep_dir
        self.settings = load_settings(sweep_dir)
        self.params = self.settings.params()
        self.base_path = sweep_dir / "base.yaml"
        self.base_raw = yaml.safe_load(self.base_path.read_text())
        self.objective = Objective.of(build_config(self.base_raw), self.settings.objective)
        self.unit, self.every = self.settings.report_unit()
        store = storage(sweep_dir)
        existing = len(optuna.load_study(study_name=STUDY_NAME, storage=store).trials)
        self.study = optuna.load_study(
            study_name=STUDY_NAME,
            storage=store,
            sampler=make_sampler(self.settings, existing),
            pruner=make_pruner(self.settings),
        )
        self.running: dict[int, Running] = {}
        self.console = console or SweepConsole()
        self.settings.cores_per_trial = usable_core_slots(self.settings)
        self.process_factory = process_factory
        self.deadline = (time.time() + 60 * self.settings.max_minutes) if self.settings.max_minutes else None

    # ------------------------------------------------------------ counting
    def finished(self) -> list[optuna.trial.FrozenTrial]:
        """Trials that count toward --trials: finished, and not interrupted (those run again on --resume)."""
        retried = {t.user_attrs.get("retry_of") for t in self.study.trials}
        return [
            t
            for t in self.study.trials
            if t.state in FINISHED and not t.user_attrs.get("interrupted") and t.number not in retried
        ]

    def wants_more(self) -> bool:
        time_left = self.deadline is None or time.time() < self.deadline
        return time_left and len(self.finished()) + len(self.running) < self.settings.trials

    # ------------------------------------------------------------ resume
    def requeue_unfinished(self) -> int:
        """After Ctrl-C or a crash: a trial still RUNNING in the study (its sweep died) is recorded FAIL, and
        it and every interrupted trial is queued again with the same values; the new trial continues the
        old run from its checkpoint when there is one (`tianji train --resume`)."""
        retried = {t.user_attrs.get("retry_of") for t in self.study.trials}
        queued = 0
        for t in self.study.trials:
            stale = t.state == optuna.trial.TrialState.RUNNING
            if stale:
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            if (stale or t.user_attrs.get("interrupted")) and t.number not in retried:
                run_dir = t.user_attrs.get("run_dir", f"trials/{t.number:04d}")
                attrs: dict[str, Any] = {"retry_of": t.number, "retry_reason": "stale" if stale else "interrupted"}
                if has_checkpoint(self.dir / run_dir):
                    attrs["continue_run"] = run_dir
                self.study.enqueue_trial(t.params, user_attrs=attrs)
                queued += 1
        return queued

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        """'done' (all trials finished), 'time' (--max-minutes) or 'interrupted' (Ctrl-C)."""
        requeued = self.requeue_unfinished()
        if requeued:
            self.console.event(f"resuming: {requeued} interrupted trial(s) queued again")
        try:
            while True:
                while len(self.running) < self.settings.parallel and self.wants_more():
                    self.start_trial()
                if not self.running:
                    break
                for number in list(self.running):
                    self.step(self.running[number])
                self.console.live(self.status_line())
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self.stop_all()
            self.write_outputs(plots=True)
            return "interrupted"
        self.write_outputs(plots=True)
        return "done" if len(self.finished()) >= self.settings.trials else "time"

    def start_trial(self) -> None:
        trial = self.study.ask()
        values = {p.key: p.suggest(trial) for p in self.params}
        continue_run = trial.user_attrs.get("continue_run")
        run_rel = continue_run or f"trials/{trial.number:04d}"
        trial.set_user_attr("run_dir", run_rel)
        run_dir = self.dir / run_rel
        overrides = list(self.settings.trial_overrides)
        if not continue_run:
            overrides += [override(key, value) for key, value in values.items()]
        command = train_command(
            self.base_path, run_dir, overrides, self.settings.launcher, self.settings.address, resume=bool(continue_run)
        )
        slot = min(set(range(self.settings.parallel)) - {r.slot for r in self.running.values()})
        cores = self.settings.cores_per_trial[slot] if self.settings.cores_per_trial else None
        process = self.process_factory(command, run_dir, cores)
        running = Running(trial, process, slot, next_point=self.every)
        if continue_run:  # the old trial's reports carry over, so the pruner judges the whole run
            old = self.study.trials[trial.user_attrs["retry_of"]].intermediate_values
            for step, value in sorted(old.items()):
                trial.report(value, step)
            running.next_point = (max(old) + self.every) if old else self.every
            running.reported = bool(old)
        process.start()
        self.running[trial.number] = running
        what = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
        self.console.event(
            f"trial {trial.number} started{' (continues ' + continue_run + ')' if continue_run else ''}: {what}"
        )

    def step(self, r: Running) -> None:
        """Read the trial's new rows, report them, and stop it when pruned, hung or over its budget."""
        rows = r.process.new_rows()
        if rows:
            r.last_row, r.last_row_at = rows[-1], time.time()
        for row in rows:
            self.report(r, row)
        code = r.process.poll()
        if code is not None:
            self.finish(r, code)
            return
        if r.process.interrupted_at is not None:
            if time.time() - r.process.interrupted_at > self.settings.grace_s:
                r.failure = r.failure or "did not stop within the grace period after SIGINT; killed"
                r.process.kill()
            return
        budget = self.objective.budget_s
        if budget is not None and r.process.elapsed() > budget + self.settings.grace_s:
            r.failure = f"still running {r.process.elapsed():.0f} s after start (budget {budget:g} s + grace)"
            r.process.interrupt()
        elif time.time() - r.last_row_at > self.settings.silent_s:
            r.failure = f"hung: no metrics row for {self.settings.silent_s:g} s"
            r.process.interrupt()

    def report(self, r: Running, row: dict[str, Any]) -> None:
        """Report the objective-so-far at every report point this row has passed, and ask the pruner after
        each: a trial is judged at the point it reached, however many rows one poll brought."""
        point = row.get(self.unit)
        if point is None:
            return
        while r.next_point <= float(point) and not r.pruned:  # a pruned trial is judged where it was pruned
            value = self.objective.intermediate(row)
            if value is not None:
                r.trial.report(value, r.next_point)
                r.reported = True
            r.next_point += self.every
            settled = self.objective.reached(row)  # it stops by itself now, with its final value
            if r.reported and not settled and not r.interrupted and r.failure is None and r.trial.should_prune():
                r.pruned = True
                r.process.interrupt()

    def finish(self, r: Running, code: int) -> None:
        """Record the trial's outcome in the study: COMPLETE, PRUNED or FAIL (with why)."""
        r.process.reap()
        summary = r.process.summary()
        state, value, note = self.outcome(r, code, summary)
        if summary is not None:
            for key in (
                "target_reached",
                "time_to_target_s",
                "final_return_mean100",
                "final_eval_return_mean",
                "final_eval_win_rate",
                "env_steps",
                "wall_time_s",
                "stop_reason",
            ):
                r.trial.set_user_attr(key, summary.get(key))
        if note:
            r.trial.set_user_attr("note", note)
        if r.interrupted and r.failure is None and state == optuna.trial.TrialState.FAIL:
            r.trial.set_user_attr("interrupted", True)
        if state == optuna.trial.TrialState.COMPLETE and value is not None:
            self.fill_remaining_points(r, value)
        self.study.tell(r.trial, value if state == optuna.trial.TrialState.COMPLETE else None, state=state)
        del self.running[r.trial.number]  # only once told: a Ctrl-C before leaves it to stop_all, not RUNNING
        shown = f" {value:.4g}" if value is not None else ""
        self.console.event(f"trial {r.trial.number} {state.name}{shown}{' (' + note + ')' if note else ''}")
        self.write_outputs(plots=False)

    def outcome(
        self, r: Running, code: int, summary: dict[str, Any] | None
    ) -> tuple[optuna.trial.TrialState, float | None, str | None]:
        # it ended on its own (a stop request may have come during its shutdown): its summary's result counts
        natural = summary is not None and summary.get("stop_reason") not in (None, "interrupted", "error")
        if natural and summary is not None:
            value = self.objective.final(summary)
            if value is None:
                return optuna.trial.TrialState.FAIL, None, f"no {self.objective.name} value in summary.json"
            return optuna.trial.TrialState.COMPLETE, value, None
        if r.pruned:
            return optuna.trial.TrialState.PRUNED, None, None
        if r.failure:  # hung or over budget before any Ctrl-C: a result, not a trial to run again
            return optuna.trial.TrialState.FAIL, None, r.failure
        if r.interrupted:
            return optuna.trial.TrialState.FAIL, None, "interrupted (runs again on --resume)"
        return optuna.trial.TrialState.FAIL, None, f"exit code {code}: {r.process.log_tail()}"

    def fill_remaining_points(self, r: Running, value: float) -> None:
        """A trial that reached its target early keeps its final value at the report points up to the budget,
        so later trials are compared with it there too (else only slower trials would remain to compare with)."""
        limit = self.objective.budget_s if self.unit == "time_s" else _env_step_budget(self.base_raw)
        if limit is None:
            return
        point = r.next_point
        while point <= limit and point < r.next_point + 1000 * self.every:
            r.trial.report(self.value_at(point, value), point)
            point += self.every

    def value_at(self, point: int, final: float) -> float:
        """A finished trial's value at a report point after its last metrics row: its final value, except that
        a time to target counts only from the point it was reached (before it: not reached, nearly there)."""
        reached = self.objective.budget_s is None or final <= self.objective.budget_s
        if self.objective.name == "time_to_target" and self.unit == "time_s" and point < final and reached:
            return self.objective.penalised(self.objective.target)
        return final

    def stop_all(self) -> None:
        """Ctrl-C: interrupt every running trial (each writes its checkpoint and summary), wait for them (a
        second Ctrl-C kills them), and record them as interrupted so --resume runs them again."""
        self.console.event(f"stopping {len(self.running)} running trial(s) (Ctrl-C again to kill them)")
        for r in self.running.values():
            r.interrupted = True
            r.process.interrupt()
        deadline = time.time() + self.settings.grace_s
        try:
            while self.running and time.time() < deadline:
                for r in list(self.running.values()):
                    code = r.process.poll()
                    if code is not None:
                        self.finish(r, code)
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        for r in list(self.running.values()):
            r.process.kill()
            self.finish(r, r.process.wait())

    # ------------------------------------------------------------ output
    def status_line(self) -> str:
        done = self.finished()
        states = [t.state for t in done]
        parts = [f"trials {len(done)}/{self.settings.trials} done"]
        for r in self.running.values():
            metric = self.objective.intermediate(r.last_row) if r.last_row else None
            parts.append(
                f"#{r.trial.number} {r.process.elapsed():.0f}s "
                + (f"now {metric:.4g}" if metric is not None else "starting")
            )
        complete = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
        if complete:
            best = (
                min(complete, key=lambda t: float(t.value or 0.0))
                if self.objective.direction == "minimize"
                else max(complete, key=lambda t: float(t.value or 0.0))
            )
            parts.append(f"best #{best.number} {best.value:.4g}")
        parts.append(
            f"{states.count(optuna.trial.TrialState.PRUNED)} pruned, "
            f"{states.count(optuna.trial.TrialState.FAIL)} failed"
        )
        if self.deadline:
            parts.append(f"{max(0.0, self.deadline - time.time()) / 60:.1f} min left")
        return " | ".join(parts)

    def write_outputs(self, plots: bool) -> None:
        write_outputs(
            self.dir, self.study, self.params, self.objective, self.base_raw, plots=plots, console=self.console
        )


def _env_step_budget(raw: dict[str, Any]) -> int | None:
    return (raw.get("stop") or {}).get("max_env_steps")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else json.dumps(value)


class SweepConsole:
    """One live line (redrawn in a terminal, printed every 15 s otherwise) and event lines above it."""

    def __init__(self, stream: Any = None):
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_plain = 0.0
        self._width = 0

    def live(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(self._width))
            self._width = min(200, len(line))
            self.stream.flush()
        elif time.time() - self._last_plain > 15:
            self._last_plain = time.time()
            self.event(line)

    def event(self, line: str) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(line + "\n")
        self.stream.flush()


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a trial's run can go on from a checkpoint (`tianji train --resume`): a set that verifies."""
    try:
        return CheckpointSets(run_dir / "checkpoints").find_good() is not None
    except CheckpointError:  # sets, none good: the trial starts over
        return False
