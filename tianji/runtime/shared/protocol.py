"""The actor-learner protocol and the driver's orders as typed messages, defined once for both sides (as
`events.py` is for what roles tell the driver).

Each message is a frozen dataclass: `header()` gives the msgpack map that goes on the wire (with
`kind`), and `parse(header)` checks a received map field by field, raising WireError that names the
field and what was expected; a role counts and logs such a message and goes on (nothing running is
lost). The wire format itself (msgpack header plus raw array frames) is tianji.runtime.transport.wire.

    actor -> learner    Hello, FragmentNotice, Probe
    learner -> actor    Weights (the reply to a hello, and every publish), Credit, Probe (its echo)
    driver -> roles     Stop, LearnerRestarted, Heartbeat

    link.send(pack_header(Hello(actor=0, slots=2).header()))
    message = parse(unpack_header(frame), TO_LEARNER)   # Hello | FragmentNotice | Probe, or WireError
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from tianji.runtime.transport.wire import WireError

MAX_SLOTS = 1024  # an actor announcing more slots than this is refused


def _int(header: Mapping[str, Any], key: str, kind: str, low: int = 0, high: int | None = None) -> int:
    """header[key] as an int in [low, high], or WireError naming the field."""
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise WireError(f"{kind}: {key!r} must be an int {bound}, got {value!r}")
    return value


def _optional_int(header: Mapping[str, Any], key: str, kind: str, low: int = 0, high: int | None = None) -> int | None:
    return None if header.get(key) is None else _int(header, key, kind, low, high)


def _slots(value: Any, kind: str, key: str) -> tuple[int, ...]:
    if not (isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in value)):
        raise WireError(f"{kind}: {key!r} must be a list of slot numbers, got {value!r}")
    return tuple(value)


class Message:
    """A message of one `kind`: its header on the wire and how a received one is checked."""

    kind: ClassVar[str]

    def header(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def parse(cls: type[M], header: Mapping[str, Any]) -> M:
        raise NotImplementedError


M = TypeVar("M", bound=Message)


# ---------------------------------------------------------------- actor -> learner


@dataclass(frozen=True)
class Resync:
    """What a link that came back after a cut holds: its credits, and the slots of fragments it sent that
    no credit has answered (lost on the way, or still coming)."""

    credits: tuple[int, ...]
    sent: tuple[int, ...]


@dataclass(frozen=True)
class Hello(Message):
    """An actor (or the evaluator: no `actor`, fills no slots) asks for weights; an actor's `slots` become
    the learner's to grant (none: balance.max_inflight)."""

    kind: ClassVar[str] = "hello"
    actor: int | None = None
    slots: int | None = None
    role: str | None = None
    resync: Resync | None = None

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"kind": self.kind}
        for key in ("actor", "slots", "role"):
            if getattr(self, key) is not None:
                header[key] = getattr(self, key)
        if self.resync is not None:
            header["resync"] = {"credits": list(self.resync.credits), "sent": list(self.resync.sent)}
        return header

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Hello:
        resync = header.get("resync")
        if resync is not None:
            if not isinstance(resync, dict):
                raise WireError(f"hello: 'resync' must map 'credits' and 'sent' to slot numbers, got {resync!r}")
            resync = Resync(
                _slots(resync.get("credits", []), "hello", "credits"), _slots(resync.get("sent"), "hello", "sent")
            )
        role = header.get("role")
        if role is not None and not isinstance(role, str):
            raise WireError(f"hello: 'role' must be a string, got {role!r}")
        return cls(
            _optional_int(header, "actor", "hello"), _optional_int(header, "slots", "hello", 1, MAX_SLOTS), role, resync
        )

    def with_resync(self, credits: list[int], sent: list[int]) -> Hello:
        return Hello(self.actor, self.slots, self.role, Resync(tuple(credits), tuple(sorted(sent))))


@dataclass(frozen=True)
class FragmentNotice(Message):
    """A fragment is ready in `slot`: who made it, with which policy version, in which learner incarnation
    (`epoch`). `location`: where its arrays are, for the transport (a shared-memory file and its layout;
    or nothing, the arrays then follow in frames)."""

    kind: ClassVar[str] = "fragment"
    slot: int
    epoch: int
    actor: int
    seq: int
    version: int
    env_steps: int
    location: Mapping[str, Any] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.location, **{key: getattr(self, key) for key in NOTICE_FIELDS}}

    @property
    def in_shared_memory(self) -> bool:
        return "shm" in self.location

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> FragmentNotice:
        slot, epoch, actor, seq, version, env_steps = (_int(header, key, "fragment") for key in NOTICE_FIELDS)
        location = {key: value for key, value in header.items() if key not in NOTICE_FIELDS and key != "kind"}
        return cls(slot, epoch, actor, seq, version, env_steps, location)


NOTICE_FIELDS = ("slot", "epoch", "actor", "seq", "version", "env_steps")


@dataclass(frozen=True)
class Probe(Message):
    """An actor on another machine times its link: the learner echoes probe `n` at once (without its
    payload, which rides in frames)."""

    kind: ClassVar[str] = "probe"
    n: int
    size: int | None = None

    def header(self) -> dict[str, Any]:
        return {"kind": self.kind, "n": self.n, **({"size": self.size} if self.size is not None else {})}

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Probe:
        return cls(_int(header, "n", "probe"), _optional_int(header, "size", "probe"))


# ---------------------------------------------------------------- learner -> actor


@dataclass(frozen=True)
class Weights(Message):
    """Versioned weights (arrays in frames): published, or the reply to a hello (`resync`: to one that
    came after a cut)."""

    kind: ClassVar[str] = "weights"
    version: int
    epoch: int
    resync: bool = False

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"kind": self.kind, "version": self.version, "epoch": self.epoch}
        return {**header, "resync": True} if self.resync else header

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Weights:
        return cls(_int(header, "version", "weights"), _int(header, "epoch", "weights"), bool(header.get("resync")))


@dataclass(frozen=True)
class Credit(Message):
    """The learner grants `slot` to its actor: fill it with weights of `min_version` or newer; `exact`
    (balance.schedule deterministic): with exactly the weights of that version, which follow as arrays."""

    kind: ClassVar[str] = "credit"
    slot: int
    min_version: int
    epoch: int
    exact: bool = False

    def header(self) -> dict[str, Any]:
        header = {"kind": self.kind, "slot": self.slot, "min_version": self.min_version, "epoch": self.epoch}
        return {**header, "exact": True} if self.exact else header

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Credit:
        exact = header.get("exact", False)
        if not isinstance(exact, bool):
            raise WireError(f"credit: 'exact' must be a bool, got {exact!r}")
        return cls(
            _int(header, "slot", "credit"),
            _int(header, "min_version", "credit"),
            _int(header, "epoch", "credit"),
            exact,
        )


# ---------------------------------------------------------------- driver -> roles


class _Signal(Message):
    """A message that is only its kind."""

    def header(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> _Signal:
        return cls()


@dataclass(frozen=True)
class Stop(_Signal):
    kind: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Heartbeat(_Signal):
    """The driver is alive (roles exit after supervision.driver_timeout_s without a message)."""

    kind: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class LearnerRestarted(Message):
    """The driver restarted the learners (incarnation `epoch`); `learners`: where each now listens, by rank
    ({"fragments": endpoint, "weights": endpoint})."""

    kind: ClassVar[str] = "learner_restarted"
    epoch: int
    learners: tuple[Mapping[str, str], ...] = ()

    def header(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "learners": [dict(where) for where in self.learners]}

    def endpoints_of(self, rank: int) -> Mapping[str, str]:
        return self.learners[rank] if rank < len(self.learners) else {}

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> LearnerRestarted:
        learners = header.get("learners", [])
        if not (
            isinstance(learners, list)
            and all(isinstance(w, dict) and all(isinstance(v, str) for v in w.values()) for w in learners)
        ):
            raise WireError(f"learner_restarted: 'learners' must be a list of endpoint maps, got {learners!r}")
        return cls(_int(header, "epoch", "learner_restarted"), tuple(learners))


TO_LEARNER: tuple[type[Message], ...] = (Hello, FragmentNotice, Probe)
TO_ACTOR: tuple[type[Message], ...] = (Weights, Credit, Probe)
ORDERS: tuple[type[Message], ...] = (Stop, LearnerRestarted, Heartbeat)


def parse(header: Mapping[str, Any], expected: tuple[type[Message], ...]) -> Message:
    """The header as the message its `kind` names, checked; WireError for a kind not in `expected` or a
    field that is missing or of the wrong type."""
    kinds = {message.kind: message for message in expected}
    kind = header.get("kind")
    if kind not in kinds:
        raise WireError(f"unexpected message kind {kind!r} (expected one of {sorted(kinds)})")
    return kinds[kind].parse(header)
