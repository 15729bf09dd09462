"""The messages roles send the driver on the events channel, defined once for both sides.

Roles build them with the functions below (through their reporters); the driver checks every one
it receives with `checked_event` before the monitor sees it. Counters are *deltas* since the
role's previous event, so a restarted role never counts twice:

    {"kind": "actor", "role": "actor0", "id": 0, "episodes": [[500.0, 500]], "env_steps": 512, ...}
    {"kind": "learner", "role": "learner0", "rank": 0, "version": 7, "lags": [0, 1], "dropped_lags": [],
     "stats": {"policy_loss": ...}, "replay_ratio": 0.0, "updates": 1, "samples_trained": 2048, ...}
"""

from __future__ import annotations

import re
from numbers import Real
from typing import Any, Literal, TypedDict, cast

from tianji.runtime.transport.wire import WireError


class ActorCounters(TypedDict):
    env_steps: int
    fragments: int
    busy_s: float
    wait_s: float
    bad_messages: int


class LearnerCounters(TypedDict):
    updates: int
    samples_trained: int
    fragments_consumed: int
    dropped: int  # over balance.max_policy_lag
    busy_s: float
    wait_s: float
    bad_messages: int
    stale_notices: int  # from an earlier learner incarnation or a replaced actor: ignored
    fragments_repeated: int  # a fragment an actor had already delivered, come again: never trained twice
    refused_peers: int  # TCP handshakes refused: peers without the run's key
    fragments_in_frames: int  # arrays that came over the network rather than through shared memory
    link_resyncs: int  # links that came back after a cut (each says hello again with what it holds)
    fragments_lost: int  # sent on a link that was cut, never arrived
    credits_voided: int  # grants voided by a resync
    credits_granted: int
    insert_blocked_s: float  # the rate limiter held the actors back
    sample_blocked_s: float  # the rate limiter held the learner back


ACTOR_COUNTERS: tuple[str, ...] = tuple(ActorCounters.__annotations__)
LEARNER_COUNTERS: tuple[str, ...] = tuple(LearnerCounters.__annotations__)


class ActorEvent(ActorCounters):
    kind: Literal["actor"]
    role: str
    id: int
    episodes: list[tuple[float, ...]]  # finished (return, length[, won])
    episode_fragments: list[int]  # the seq of the fragment each episode ended in (their order in a schedule)


class LearnerEvent(LearnerCounters):
    kind: Literal["learner"]
    role: str
    rank: int
    version: int
    lags: list[int]  # of the fragments trained on since the last event
    dropped_lags: list[int]
    stats: dict[str, float]  # the algorithm's train/ metrics of its last update
    replay_ratio: float
    lag_bound: float  # the lag bound now (it moves under balance.max_policy_lag: auto)
    inflight: float  # the credits an actor may hold now
    schedule: str  # balance.schedule in force: "deterministic", or "free" (set, or fallen back to)
    schedule_done: bool  # deterministic with stop.max_env_steps: every fragment of its budget trained
    version_stats: list[tuple[int, dict[str, float]]]  # deterministic: each update's stats since the last event


class EvalEvent(TypedDict, total=False):
    kind: Literal["eval"]
    role: str
    return_mean: float
    return_min: float
    length_mean: float
    version: int
    episodes: int
    win_rate: float  # envs that report wins


class CheckpointNotice(TypedDict, total=False):
    kind: Literal["checkpoint"]  # a learner checkpoint was staged (or its bytes follow, from another machine)
    version: int
    rank: int
    epoch: int  # of the learner group that wrote it
    staged: str  # its file in checkpoints/staging/ (absent: the bytes follow)
    failed: str  # the write failed (a full disk): why, and where


class MeasuredCosts(TypedDict):
    kind: Literal["measured"]  # costs a role measured once, at start (a learner group's collectives)
    role: str
    costs: dict[str, float]


class RoleNote(TypedDict, total=False):
    kind: Literal["heartbeat", "error", "stopped"]
    role: str
    message: str  # error: the traceback
    version: int  # stopped: the learner's last version


Event = ActorEvent | LearnerEvent | EvalEvent | CheckpointNotice | MeasuredCosts | RoleNote
_COUNTERS = {"actor": ACTOR_COUNTERS, "learner": LEARNER_COUNTERS}


def actor_event(
    actor_id: int,
    episodes: list[tuple[float, ...]],
    counts: dict[str, float],
    episode_fragments: list[int] | None = None,
) -> ActorEvent:
    event = {
        "kind": "actor",
        "role": f"actor{actor_id}",
        "id": actor_id,
        "episodes": episodes,
        "episode_fragments": episode_fragments if episode_fragments is not None else [],
    }
    return cast(ActorEvent, {**event, **{key: counts[key] for key in ACTOR_COUNTERS}})


def learner_event(
    rank: int,
    version: int,
    lags: list[int],
    dropped_lags: list[int],
    stats: dict[str, float],
    replay_ratio: float,
    counts: dict[str, float],
    lag_bound: float = float("nan"),
    inflight: float = float("nan"),
    schedule: str = "free",
    schedule_done: bool = False,
    version_stats: list[tuple[int, dict[str, float]]] | None = None,
) -> LearnerEvent:
    event = {
        "kind": "learner",
        "role": f"learner{rank}",
        "rank": rank,
        "version": version,
        "lags": lags,
        "dropped_lags": dropped_lags,
        "stats": stats,
        "replay_ratio": replay_ratio,
        "lag_bound": lag_bound,
        "inflight": inflight,
        "schedule": schedule,
        "schedule_done": schedule_done,
        "version_stats": version_stats or [],
    }
    return cast(LearnerEvent, {**event, **{key: counts[key] for key in LEARNER_COUNTERS}})


def measured(role: str, costs: dict[str, float]) -> MeasuredCosts:
    return {"kind": "measured", "role": role, "costs": costs}


def checkpoint_notice(
    version: int, rank: int, epoch: int = 0, staged: str | None = None, failed: str | None = None
) -> CheckpointNotice:
    notice: CheckpointNotice = {"kind": "checkpoint", "version": version, "rank": rank, "epoch": epoch}
    if staged is not None:
        notice["staged"] = staged
    if failed is not None:
        notice["failed"] = failed
    return notice


def heartbeat(role: str) -> RoleNote:
    return {"kind": "heartbeat", "role": role}


def role_error(role: str, message: str) -> RoleNote:
    return {"kind": "error", "role": role, "message": message}


def stopped(version: int) -> RoleNote:
    return {"kind": "stopped", "version": version}


KINDS = ("actor", "learner", "eval", "checkpoint", "measured", "heartbeat", "error", "stopped")


def checked_event(header: dict[str, Any]) -> Event:
    """`header` as an event, or WireError naming what is wrong (an unknown kind, a counter that is not a number)."""
    kind = header.get("kind")
    if kind not in KINDS:
        raise WireError(f"event kind {kind!r} is not one of {KINDS}")
    for key in _COUNTERS.get(kind, ()):
        value = header.get(key, 0)
        if not isinstance(value, Real) or isinstance(value, bool):
            raise WireError(f"{kind} event field {key!r} must be a number, got {value!r}")
    if kind == "checkpoint":
        _check_notice(header)
    if kind == "measured" and not (
        isinstance(header.get("costs"), dict)
        and all(isinstance(v, Real) and not isinstance(v, bool) for v in header["costs"].values())
    ):
        raise WireError(f"measured event field 'costs' must map names to numbers, got {header.get('costs')!r}")
    return header  # type: ignore[return-value]


def _check_notice(header: dict[str, Any]) -> None:
    for key in ("version", "rank", "epoch"):
        value = header.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WireError(f"checkpoint notice field {key!r} must be a non-negative int, got {value!r}")
    staged = header.get("staged")
    if staged is not None and not (isinstance(staged, str) and re.fullmatch(r"learner-r\d+-v\d+-e\d+\.pt", staged)):
        raise WireError(f"checkpoint notice field 'staged' must name a staged learner file, got {staged!r}")
    if "failed" in header and not isinstance(header["failed"], str):
        raise WireError(f"checkpoint notice field 'failed' must be a string, got {header['failed']!r}")
