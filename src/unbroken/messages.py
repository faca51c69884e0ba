"""Every message that crosses a process boundary, as frozen typed values, and their one codec.

Three boundaries carry them:

- the control channel between the coordinator and each node agent (TCP, HMAC-authenticated:
  `unbroken.launch.protocol.Channel` decodes and validates every frame into one of these types
  before anyone reads it): `Hello`, `NodeBeat`, `Started`, `RankExited`, `RankHung`,
  `Stopped`, `MemoryReport` from agents; `StartGeneration`, `StopGeneration`, `Shutdown` to
  them;
- node-local datagrams from trainers and shadows to their agent (Unix sockets): `RankBeat` on
  the heartbeat socket, `ReclaimRequest` on the reclamation socket, `ReclaimAnswer` back;
- the agent to a shadow, one line each on its stdin: `WarmUp` (run the GPU warm-up now),
  `MapRetained` (parked: map the device's retained state now), then `Promote`.

Wire form: a JSON object `{"op": <the type's OP>, <field>: <value>, ...}`. `decode` accepts
only the types the receiver names, requires every field without a default, rejects unknown
fields, and checks each value against the field's annotation (int, float, str, bool, enums,
lists and dicts of those, `X | None`, nested message parts). A message that fails is a
`MessageError` naming the op and the field; the receiver logs it and drops it (or the
connection), never acts on it.

Hand-written (≈ 100 lines over `dataclasses` and `typing`) rather than msgspec or pydantic: the
GPU machines' image carries neither and cannot install packages, and every process of a job —
trainers included — speaks these messages; the records are flat JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "MEMORY_EVENTS",
    "Hello",
    "MapRetained",
    "MemoryReport",
    "Message",
    "MessageError",
    "NodeBeat",
    "Promote",
    "RankBeat",
    "RankExited",
    "RankHung",
    "RankStatus",
    "ReclaimAnswer",
    "ReclaimRequest",
    "ShadowLaunch",
    "ShadowPlan",
    "Shutdown",
    "StartGeneration",
    "Started",
    "StopGeneration",
    "Stopped",
    "WarmUp",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
]


class MessageError(ValueError):
    """A message that does not match its type (the text names the op and the field)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every message; `OP` is its name on the wire."""

    OP: ClassVar[str] = ""


# -- agent -> coordinator ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """An agent introduces its node (first message on a connection)."""

    OP: ClassVar[str] = "hello"
    node: int
    pid: int
    host: str = "127.0.0.1"
    generation: int = -1
    """The newest generation this agent has run (-1: none, a fresh agent). A node declared
    lost may rejoin only with a fresh agent: one that ran a generation of the job (a partition
    healed; its processes of that generation may still run) is fenced."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeBeat(Message):
    """The node is alive (the second level of heartbeats; raw rank beats never leave a node)."""

    OP: ClassVar[str] = "beat"
    t: float
    trainers: int
    generation: int = -1
    """The generation the node runs (its last `StartGeneration`; -1 before the first). One
    newer than the coordinator's is a contradiction and refused."""
    shadows_for: int = -1
    """The generation every rank of the node has a live shadow for (-1: none, or some rank's
    is not spawned yet): whether promoted shadows elsewhere must regroup
    (`StartGeneration.regroup`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowLaunch:
    """The shadows an agent started with a generation."""

    level: int
    generation: int
    start: str
    """"fork" (from the node's fork server) or "exec"."""
    fork_failed: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Started(Message):
    OP: ClassVar[str] = "started"
    generation: int
    t: float
    promoted: bool
    """The generation's trainers are promoted shadows (no process start)."""
    shadows_ready: int
    shadows: ShadowLaunch | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExited(Message):
    OP: ClassVar[str] = "rank_exit"
    rank: int
    generation: int
    returncode: int
    t: float
    said: str = ""
    """The last line the trainer wrote to its log (why it died, if it said)."""
    completed: int = -1
    """The last iteration the rank reported complete in this generation (-1: none)."""
    iteration: int = -1
    """The iteration its last heartbeat was in (-1: it never reached one)."""
    phase: str = ""
    """The phase its last heartbeat was in."""
    traceback: str = ""
    """The trainer's traceback from its log, when the job runs with --debug."""
    device_lost: str = ""
    """Why the agent's health check found the rank's device lost for good ("" : healthy, the
    failure is hardware-operable). Also sent, with no process behind it, for a rank the agent
    refused to start on a lost device."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankHung(Message):
    OP: ClassVar[str] = "rank_hung"
    rank: int
    generation: int
    silent_s: float
    t: float
    phase: str = ""
    iteration: int = -1
    completed: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopped(Message):
    OP: ClassVar[str] = "stopped"
    generation: int
    t: float
    took_s: float


MEMORY_EVENTS = frozenset(
    {"memory_budget", "shadows_reclaimed", "shadow_level", "oom", "memory_report"}
)
"""What an agent's `MemoryReport` may log (see unbroken.shadow.memory and .policy)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport(Message):
    """A node's memory budget and reclamation controller: logged as an event."""

    OP: ClassVar[str] = "memory"
    event: str
    t: float
    fields: dict[str, Any] = field(default_factory=dict)
    generation: int = -1
    """The generation the node ran when it reported (logged with the event)."""

    def __post_init__(self) -> None:
        if self.event not in MEMORY_EVENTS:
            raise MessageError(f"memory: unknown event {self.event!r}")


# -- coordinator -> agent ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowPlan:
    """Shadows to prepare for the next generation."""

    level: int
    start: str
    """"fork" or "exec" (recovery.shadow_start)."""
    next_spec: str
    """The spec file of the generation they will join."""
    attempt: int = 0
    """The shadow set's number, the same on every node (their mirror world's rendezvous:
    shadows of several nodes meet only under one number, so an agent that joined later — a
    returned node — must not count its own); 0: the agent counts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartGeneration(Message):
    OP: ClassVar[str] = "start"
    generation: int
    spec: str
    ranks: list[int]
    """The ranks this node runs (its local ranks in this order)."""
    heartbeat_timeout_s: float
    node_heartbeat_s: float
    shadows: ShadowPlan | None = None
    memory_budget_mb: int = 0
    memory_reclaim: bool = True
    state_managers: dict[str, str] = field(default_factory=dict)
    """device -> state manager socket (in-place mode): a state manager belongs to a device
    and outlives the ranks that run there."""
    log_dir: str = ""
    debug: bool = False
    devices: dict[str, int] = field(default_factory=dict)
    """rank -> the device it runs on (empty: rank r on device r)."""
    device_registry: str = ""
    """Where the agent's health check reads CPU devices' health (`unbroken.devices`)."""
    world_changed: bool = False
    """The generation's world differs from the one its shadows were prepared for (a device was
    lost): start fresh trainers; the shadows are discarded."""
    regroup: bool = False
    """Promoted shadows leave the group their set formed (a mirror world of every node's
    shadows) and join the generation's own rendezvous: some node has no live shadow for each
    of its ranks (`NodeBeat.shadows_for`) and starts fresh trainers, which join there."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopGeneration(Message):
    OP: ClassVar[str] = "stop"
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    OP: ClassVar[str] = "shutdown"
    fenced: str = ""
    """Not the job's end: this node was declared lost earlier and is refused (why); its agent
    stops every process of the node and exits with an error."""
    generation: int = -1
    """The coordinator's generation when it was sent (the agent says it when fenced)."""


# -- trainer <-> agent, inside a node ----------------------------------------------------------
class RankStatus(enum.StrEnum):
    STARTING = "starting"
    """Pre-initializing or joining; not yet at an iteration."""
    SHADOW_READY = "shadow_ready"
    """A shadow parked at its level (`RankBeat.level`), waiting for promotion."""
    TRAINING = "training"
    """Inside iterations; `RankBeat.phase` is the phase it is in."""
    EXITING = "exiting"
    """Done, tearing down on purpose (its group teardown may be slow)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankBeat(Message):
    OP: ClassVar[str] = "rank_beat"
    rank: int
    generation: int
    pid: int
    t: float
    status: RankStatus
    iteration: int = -1
    phase: str = ""
    """The `unbroken.train.Phase` it is in (TRAINING)."""
    completed: int = -1
    """The last iteration it completed in this generation (-1: none)."""
    level: int = 0
    """Its shadow level (SHADOW_READY)."""
    footprint: dict[str, int] = field(default_factory=dict)
    """A shadow's private bytes at each level it passed ("1", "2", "3")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReclaimRequest(Message):
    """A trainer's allocation failed: reclaim the node's shadows (Leto §6, OOM callback)."""

    OP: ClassVar[str] = "reclaim"
    rank: int
    generation: int
    reply: str
    """The trainer's datagram address for the `ReclaimAnswer`."""
    reason: str
    t: float
    iteration: int | None = None
    """The iteration being retried: shadows come back once the trainer is past it."""
    used: int | None = None
    total: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReclaimAnswer(Message):
    OP: ClassVar[str] = "reclaimed"
    reclaimed: int
    level_to: int | None = None
    wait_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmUp(Message):
    """To a shadow: the trainer it would replace has completed an iteration, so its GPU warm-up
    (`unbroken.shadow.warm`) no longer competes with that trainer's first one — a promoted
    trainer's first iteration after a recovery among them (`recovery.shadow_warmup`)."""

    OP: ClassVar[str] = "warm_up"


@dataclass(frozen=True, slots=True, kw_only=True)
class MapRetained(Message):
    """To a parked shadow: the trainer it would replace has completed an iteration (its retained
    regions are made and will not be re-created before the next generation), so map them now;
    promoted, it finds them mapped (`unbroken.state.client.RetainedClient.premap`)."""

    OP: ClassVar[str] = "map_retained"


@dataclass(frozen=True, slots=True, kw_only=True)
class Promote(Message):
    """A parked shadow becomes the trainer of its generation, from this final spec."""

    OP: ClassVar[str] = "promote"
    spec: str
    rank: int | None = None
    """Its rank in the final spec's world when the world changed since it was prepared (the
    same device, another rank number); None: the rank it was started for."""
    regroup: bool = False
    """The world changed: a shadow that formed its shadow set's group leaves it and joins the
    generation's own rendezvous with the final spec's world."""


# -- codec -------------------------------------------------------------------------------------
def encode(msg: Message) -> dict[str, Any]:
    """The wire form of `msg` (a JSON-ready dict with its op)."""
    return {"op": msg.OP, **_fields(msg)}


def _fields(obj: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _fields(value)
        out[f.name] = value
    return out


def encode_json(msg: Message) -> bytes:
    return json.dumps(encode(msg)).encode()


def decode(obj: Any, accept: typing.Iterable[type[Message]]) -> Message:
    """The message `obj` (a decoded JSON object) holds, if it is one of `accept`.

    Raises:
        MessageError: not an object, an op not in `accept`, or a field missing, unknown or of
            the wrong type.
    """
    ops = {cls.OP: cls for cls in accept}
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise MessageError("malformed message (no 'op')")
    cls = ops.get(obj["op"])
    if cls is None:
        raise MessageError(f"unknown op {obj['op']!r}")
    body = {k: v for k, v in obj.items() if k not in ("op", "seq")}
    return _build(cls, body, cls.OP)


def decode_json(data: bytes | str, accept: typing.Iterable[type[Message]]) -> Message:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MessageError("malformed message (not JSON)") from None
    except RecursionError:  # nesting deeper than the parser's stack: never a message of ours
        raise MessageError("malformed message (nested too deep)") from None
    return decode(obj, accept)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise MessageError(f"{where}: unknown field(s) {unknown}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{where}: missing field {f.name!r}")
            continue
        values[f.name] = _check(body[f.name], hints[f.name], f"{where}.{f.name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"{where}: {exc}") from None


def _check(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object, got {type(value).__name__}")
        return _build(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise MessageError(f"{where}: {value!r} is not a {hint.__name__}") from None
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
        return [_check(v, args[0], f"{where}[]") for v in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise MessageError(f"{where}: expected an object with string keys")
        return {k: _check(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise MessageError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
