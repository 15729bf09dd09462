"""Chaos: a run under random faults, and what it cost.

    python benchmarks/chaos.py [--preset pong-appo] [--seed 0] [--minutes 90] [--every 120 300]
                               [--faults kill-actor kill-learner stop-role kill-evaluator full-disk]
                               [--stop-s 10 30] [--disk-s 30] [--baseline RUN_DIR] [--run-dir DIR] [--set k=v]
                               [--launcher local|ray]

Trains the preset (to its target, capped at --minutes) while a schedule seeded by --seed injects one
fault every --every seconds (uniform between the two), one at a time:

- kill-actor, kill-learner, kill-evaluator: SIGKILL of that role's process (roles.json names them);
- stop-role: SIGSTOP of a random role for --stop-s seconds (uniform), then SIGCONT;
- full-disk: every process of the run may grow no file (RLIMIT_FSIZE, as a full disk answers EFBIG)
  for --disk-s seconds: checkpoints and metric rows fail to be written;
- remove-node (--launcher ray): the run goes on a Ray cluster made on this machine (a head for the driver,
  two nodes that can each hold every role); the node of a random role is removed without warning, as a
  preempted cloud machine disappears, and a fresh node is added back once the run is whole again.

After each fault it waits until the run is whole again (a killed role replaced by a live process, and
the learner's policy version past where it was when the fault came) before the next is drawn. At the
end: the target reached, the time to it against an undisturbed run of the same seed (--baseline, a
finished run directory), fragments refused as delivered twice, fragments trained over the lag bound,
checkpoint sets that fail verification, processes and shared-memory files left after exit, and
whether the policy version ever went backwards other than to a verified set after a learner fault.
Results: benchmarks/results/chaos.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tianji.config import load_config
from tianji.runtime.process.life import limit_file_size, pid_alive, process_tree, run_leftovers
from tianji.runtime.shared.checkpoint import CheckpointError, CheckpointSets, set_damage

from common import machine, summary_of, train_command

RESULTS = Path(__file__).parent / "results"
FAULTS = ("kill-actor", "kill-learner", "stop-role", "kill-evaluator", "full-disk", "remove-node")
REPLACING = ("kill-actor", "kill-learner", "kill-evaluator", "remove-node")  # the role comes back as a new process
# the faults are deliberate: the restart caps that stop a crash loop (3 learner restarts, 10 of actors)
# would end an hour of them as failed; --set overrides these
UNCAPPED_RESTARTS = ("supervision.max_learner_restarts=1000", "supervision.max_actor_restarts=1000")
WHOLE_TIMEOUT_S = 600.0  # a run not whole again by then is reported so, and the next fault comes anyway


@dataclass
class Fault:
    kind: str
    at_s: float  # seconds into the run when it was injected
    role: str = ""
    lasted_s: float = 0.0  # a stop or a full disk: how long it was held
    version_before: int = -1
    took_learner: bool = False  # the learner died with it (it resumes from a verified set)
    set_version: int | None = None  # a fault that took the learner: the newest verified set's version then
    node: str = ""  # remove-node: the node removed
    whole_after_s: float | None = None  # from the fault's end until the run was whole again; None: never
    ended_first: bool = False  # the run ended (target or cap) before it was whole again


@dataclass
class ChaosSettings:
    every_s: tuple[float, float] = (120.0, 300.0)
    faults: tuple[str, ...] = FAULTS
    stop_s: tuple[float, float] = (10.0, 30.0)
    disk_s: float = 30.0
    seed: int = 0
    quiet_end_s: float = 60.0  # no fault drawn this close to the run's cap: its recovery could not be seen


@dataclass
class Chaos:
    """One run under faults: the train command in the background, the faults injected one at a time."""

    run_dir: Path
    command: list[str]
    settings: ChaosSettings
    cap_s: float
    cluster: LoopbackCluster | None = None  # --launcher ray: the cluster the run goes on
    faults: list[Fault] = field(default_factory=list)
    pids_seen: set[int] = field(default_factory=set)
    _tree_noted_at: float = 0.0

    def run(self) -> int:
        rng = random.Random(self.settings.seed)
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir.with_suffix(".log"), "w") as log:  # the command's output, beside the run
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        self.started = time.time()
        try:
            quiet_from = self.started + self.cap_s - self.settings.quiet_end_s
            while self._sleep_until(time.time() + rng.uniform(*self.settings.every_s)) and time.time() < quiet_from:
                kind = rng.choice([k for k in self.settings.faults if self._can_inject(k)] or ["none"])
                if kind != "none":
                    self.faults.append(self._inject(kind, rng))
        finally:
            try:
                self.process.wait(timeout=self.cap_s + 300)  # the run's own cap ends it, faults or not
            except subprocess.TimeoutExpired:  # it hung: a failure to report, not a process to leave behind
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    # ------------------------------------------------------------ the run as it goes
    def _sleep_until(self, when: float) -> bool:
        """Wait until `when` while the run goes on; False once it has ended."""
        while time.time() < when:
            if self.process.poll() is not None:
                return False
            self._note_roles()
            time.sleep(0.2)
        return self.process.poll() is None

    def _roles(self) -> dict[str, int]:
        with contextlib.suppress(OSError, ValueError):
            return {name: int(pid) for name, pid in json.loads((self.run_dir / "roles.json").read_text()).items()}
        return {}

    def _note_roles(self) -> None:
        """Every process of the run seen so far (roles, and every other process below the command's)."""
        self.pids_seen.update(self._roles().values())
        if time.time() - self._tree_noted_at >= 2.0:
            self.pids_seen.update(process_tree(self.process.pid)[1:])
            self._tree_noted_at = time.time()

    def _version(self) -> int:
        """The learner's policy version in the newest metrics row (-1 before the first)."""
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            last = (self.run_dir / "metrics.jsonl").read_text().splitlines()[-1]
            return int(json.loads(last)["balance/policy_version"])
        return -1

    def _can_inject(self, kind: str) -> bool:
        roles = self._roles()
        return {
            "kill-actor": any(name.startswith("actor") for name in roles),
            "kill-learner": any(name.startswith("learner") for name in roles),
            "kill-evaluator": "evaluator" in roles,
            "stop-role": bool(roles),
            "full-disk": True,
            "remove-node": self.cluster is not None and bool(self._roles_on_removable_nodes(self._places())),
        }[kind]

    def _places(self) -> dict[str, dict]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.run_dir / "placement.json").read_text())
        return {}

    def _roles_on_removable_nodes(self, places: dict[str, dict]) -> list[str]:
        assert self.cluster is not None
        return sorted(name for name, place in places.items() if self.cluster.removable(place["node"]))

    # ------------------------------------------------------------ faults
    def _inject(self, kind: str, rng: random.Random) -> Fault:
        roles = self._roles()
        fault = Fault(kind, round(time.time() - self.started, 1), version_before=self._version())
        if kind.startswith("kill-"):
            prefix = kind.removeprefix("kill-")
            fault.role = rng.choice(sorted(name for name in roles if name.startswith(prefix)))
            self._note_learner_loss(fault, kind == "kill-learner")
            _signal(roles[fault.role], signal.SIGKILL)
        elif kind == "remove-node":
            assert self.cluster is not None
            places = self._places()
            fault.role = rng.choice(self._roles_on_removable_nodes(places))
            fault.node = places[fault.role]["node"]
            on_node = [name for name, place in places.items() if place["node"] == fault.node]
            self._note_learner_loss(fault, any(name.startswith("learner") for name in on_node))
            self.cluster.remove(fault.node)
        elif kind == "stop-role":
            fault.role = rng.choice(sorted(roles))
            fault.lasted_s = round(rng.uniform(*self.settings.stop_s), 1)
            _signal(roles[fault.role], signal.SIGSTOP)
            self._hold(fault.lasted_s)
            _signal(roles[fault.role], signal.SIGCONT)
        else:
            fault.lasted_s = self.settings.disk_s
            limit_file_size(self.process.pid, 0)
            self._hold(fault.lasted_s)
            limit_file_size(self.process.pid, resource.RLIM_INFINITY)
        fault.whole_after_s = self._wait_whole(fault, roles)
        fault.ended_first = fault.whole_after_s is None and self.process.poll() is not None
        if kind == "remove-node":
            assert self.cluster is not None
            self.cluster.add()  # the next removal has somewhere to go
        print(f"{fault.at_s:8.1f} s  {kind:<14} {fault.role:<10} whole again after {fault.whole_after_s} s", flush=True)
        return fault

    def _note_learner_loss(self, fault: Fault, took_learner: bool) -> None:
        fault.took_learner = took_learner
        if took_learner:
            fault.set_version = newest_set_version(self.run_dir)

    def _hold(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and self.process.poll() is None:
            self._note_roles()
            time.sleep(0.2)

    def _wait_whole(self, fault: Fault, roles_before: dict[str, int]) -> float | None:
        """Seconds until every role is alive (a killed one replaced) and the policy version is past where it
        was when the fault came; None when the run ended or the timeout passed first."""
        start = time.time()
        while time.time() - start < WHOLE_TIMEOUT_S and self.process.poll() is None:
            roles = self._roles()
            self.pids_seen.update(roles.values())
            replaced = fault.kind not in REPLACING or roles.get(fault.role, -1) != roles_before[fault.role]
            if replaced and all(pid_alive(pid) for pid in roles.values()) and self._version() > fault.version_before:
                return round(time.time() - start, 1)
            time.sleep(0.2)
        return None


class LoopbackCluster:
    """A Ray cluster made on this machine for --launcher ray, all on loopback: a head for the driver, and
    two nodes that can each hold every role (the roles ask for a `chaos_node` resource only they have), so
    that the roles of a removed node have somewhere to go."""

    NODE = {"num_cpus": 8, "resources": {"chaos_node": 16}, "node_ip_address": "127.0.0.1"}  # room for every role

    def __init__(self) -> None:
        import ray  # an optional dependency: only --launcher ray needs it
        from ray.cluster_utils import Cluster

        from tianji.runtime.launchers.ray_boot import loopback_only

        loopback_only(ray)
        head = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(2):
            self.add()
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def settings(self) -> list[str]:
        """The run's settings that put it on this cluster, every role on the removable nodes."""
        pinned = "{chaos_node: 1}"
        return [
            f"ray.address={self.address}",
            f"ray.learner_resources={pinned}",
            f"ray.actor_resources={pinned}",
            f"ray.evaluator_resources={pinned}",
        ]

    def removable(self, node_id: str) -> bool:
        return any(node.node_id == node_id for node in self.cluster.worker_nodes)

    def remove(self, node_id: str) -> None:
        node = next(node for node in self.cluster.worker_nodes if node.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def add(self) -> None:
        self.cluster.add_node(**self.NODE)

    def shutdown(self) -> None:
        self.cluster.shutdown()


# ---------------------------------------------------------------- process and file helpers


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def newest_set_version(run_dir: Path) -> int | None:
    with contextlib.suppress(CheckpointError, OSError, ValueError):
        good = CheckpointSets(run_dir / "checkpoints").find_good()
        return None if good is None else good.policy_version
    return None


def damaged_sets(run_dir: Path) -> list[str]:
    sets = sorted((run_dir / "checkpoints").glob("set-*"))
    return [f"{path.name}: {damage}" for path in sets if (damage := set_damage(path)) is not None]


def versions_logged(run_dir: Path) -> list[tuple[float, int]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [(r["time_s"], int(r["balance/policy_version"])) for r in rows]


def backward_steps(versions: list[tuple[float, int]], faults: list[Fault]) -> list[str]:
    """Every drop of the policy version not explained by a learner fault that restarted from a verified set
    (the version after the drop at least that set's version)."""
    kills = [f for f in faults if f.took_learner]
    found = []
    for (_, before), (t, after) in zip(versions, versions[1:], strict=False):
        if after >= before:
            continue
        cause = max((f for f in kills if f.at_s <= t), key=lambda f: f.at_s, default=None)
        if cause is None or cause.set_version is None or after < cause.set_version:
            found.append(f"at {t:.0f} s: version {before} -> {after}")
    return found


# ---------------------------------------------------------------- the report


def report(chaos: Chaos, returncode: int, baseline: Path | None) -> dict:
    run_dir, summary = chaos.run_dir, summary_of(chaos.run_dir)
    cfg = load_config(str(run_dir / "config.yaml"))
    over_bound = sum(
        n for lag, n in summary.get("policy_lag_histogram", {}).items() if int(lag) > cfg.balance.bound_at_start
    )
    # a killed learner takes the fragments in flight to it along (its restart resumes from the checkpoint
    # before them anyway): at most every actor's slots each time
    learner_kills = sum(f.took_learner for f in chaos.faults)
    in_flight_to_killed = learner_kills * cfg.topology.actor_count * cfg.balance.slots_per_actor
    undisturbed = summary_of(baseline).get("time_to_target_s") if baseline is not None else None
    to_target = summary.get("time_to_target_s")
    return {
        "preset": cfg.name,
        "seed": chaos.settings.seed,
        "launcher": "ray" if chaos.cluster is not None else "local",
        "machine": machine(),
        "returncode": returncode,
        "faults": [asdict(f) for f in chaos.faults],
        "faults_injected": len(chaos.faults),
        "faults_survived": sum(
            f.whole_after_s is not None or (f.ended_first and returncode == 0) for f in chaos.faults
        ),
        "target_reached": summary.get("target_reached"),
        "time_to_target_s": to_target,
        "undisturbed_time_to_target_s": undisturbed,
        "time_ratio": to_target / undisturbed if to_target and undisturbed else None,
        "env_steps": summary.get("env_steps"),
        "fragments_repeated": summary.get("fragments_repeated"),
        "fragments_over_bound": over_bound,
        "fragments_lost": summary.get("fragments_lost"),
        "fragments_lost_beyond_killed_learners": max(0, (summary.get("fragments_lost") or 0) - in_flight_to_killed),
        "role_restarts": summary.get("role_restarts"),
        "learner_restarts": summary.get("learner_restarts"),
        "checkpoint_write_failures": summary.get("checkpoint_write_failures"),
        "damaged_sets": damaged_sets(run_dir),
        "processes_left": sorted(pid for pid in chaos.pids_seen if pid_alive(pid)),
        "files_left": [str(path) for path in run_leftovers(chaos.process.pid)],
        "version_backwards": backward_steps(versions_logged(run_dir), chaos.faults),
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Chaos: `{result['preset']}`, seed {result['seed']}, {result.get('launcher', 'local')} launcher",
        "",
        f"Machine: {result['machine']}. {result['faults_injected']} faults injected, "
        f"{result['faults_survived']} survived (the run whole again after each).",
        "",
        "| at | fault | role | held | whole again after |",
        "|---|---|---|---|---|",
    ]
    for f in result["faults"]:
        whole = f"{f['whole_after_s']:.1f} s" if f["whole_after_s"] is not None else "never"
        whole = "the run ended first" if f["ended_first"] else whole
        held = f"{f['lasted_s']:.0f} s" if f["lasted_s"] else ""
        role = f"{f['role']}'s node" if f["kind"] == "remove-node" else f["role"]
        lines.append(f"| {f['at_s'] / 60:.1f} min | {f['kind']} | {role} | {held} | {whole} |")
    ratio = result["time_ratio"]
    lines += [
        "",
        "| check | result |",
        "|---|---|",
        f"| target reached | {'yes' if result['target_reached'] else 'no'} |",
        f"| time to target | {_minutes(result['time_to_target_s'])} (undisturbed: "
        f"{_minutes(result['undisturbed_time_to_target_s'])}; ratio {'-' if ratio is None else f'{ratio:.2f}'}, "
        "goal <= 1.3) |",
        f"| fragments delivered twice (refused, never trained twice) | {result['fragments_repeated']} |",
        f"| fragments trained over the lag bound | {result['fragments_over_bound']} |",
        f"| fragments lost on the way to a killed learner (its restart resumes from before them) | "
        f"{result['fragments_lost']} |",
        f"| fragments lost otherwise (beyond every actor's slots at each learner kill) | "
        f"{result['fragments_lost_beyond_killed_learners']} |",
        f"| checkpoint sets that fail verification | {len(result['damaged_sets'])} |",
        f"| processes left after exit | {len(result['processes_left'])} |",
        f"| shared-memory and socket files left after exit | {len(result['files_left'])} |",
        f"| policy version backwards other than to a verified set | {len(result['version_backwards'])} |",
        f"| role restarts / learner restarts / checkpoint writes failed | {result['role_restarts']} / "
        f"{result['learner_restarts']} / {result['checkpoint_write_failures']} |",
        "",
    ]
    return "\n".join(lines)


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def run_chaos(
    preset: str,
    run_dir: Path,
    settings: ChaosSettings,
    minutes: float,
    overrides: list[str],
    baseline: Path | None = None,
    launcher: str = "local",
) -> dict:
    """Train `preset` under faults (under Ray on a cluster made for it, shut down after); returns the report."""
    cluster = LoopbackCluster() if launcher == "ray" else None
    try:
        placed = [] if cluster is None else cluster.settings()
        settings_list = [
            f"seed={settings.seed}",
            f"stop.max_wall_time_s={minutes * 60}",
            *UNCAPPED_RESTARTS,
            *placed,
            *overrides,
        ]
        command = train_command(preset, run_dir, *settings_list, launcher=launcher)
        chaos = Chaos(run_dir, command, settings, minutes * 60, cluster)
        return report(chaos, chaos.run(), baseline)
    finally:
        if cluster is not None:
            cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pong-appo")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed and the fault schedule's")
    parser.add_argument("--minutes", type=float, default=90.0, help="the run's cap")
    parser.add_argument("--every", type=float, nargs=2, default=[120.0, 300.0], help="seconds between faults")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, help="default: every fault the launcher has")
    parser.add_argument("--launcher", choices=("local", "ray"), default="local")
    parser.add_argument("--stop-s", type=float, nargs=2, default=[10.0, 30.0], help="how long a role stays stopped")
    parser.add_argument("--disk-s", type=float, default=30.0, help="how long the disk stays full")
    parser.add_argument("--baseline", type=Path, help="an undisturbed finished run of the same preset and seed")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    parser.add_argument("--out", default=str(RESULTS / "chaos"), help="results path without suffix")
    args = parser.parse_args()
    faults = args.faults or [kind for kind in FAULTS if args.launcher == "ray" or kind != "remove-node"]
    if "remove-node" in faults and args.launcher != "ray":
        parser.error("remove-node needs --launcher ray (a cluster's node to remove)")
    settings = ChaosSettings(tuple(args.every), tuple(faults), tuple(args.stop_s), args.disk_s, args.seed)
    settings.quiet_end_s = max(args.every)
    result = run_chaos(args.preset, args.run_dir, settings, args.minutes, args.overrides, args.baseline, args.launcher)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
