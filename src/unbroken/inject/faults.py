"""The fault catalog and the parser of fault specs."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from unbroken.detect.levels import Level
from unbroken.errors import UserError
from unbroken.train.phases import Phase

__all__ = [
    "FaultKind",
    "FaultSpec",
    "InjectedFault",
    "SlowTarget",
    "faults_not_fired",
    "parse_fault",
]


class FaultKind(enum.StrEnum):
    KILL = "kill"
    """SIGKILL the trainer (a crash: process gone, hardware fine)."""
    HANG = "hang"
    """SIGSTOP the trainer (a hang: process alive, no progress)."""
    EXCEPTION = "exception"
    """Raise an exception out of the training loop (the trainer exits non-zero)."""
    SLOW = "slow"
    """Slow the trainer's compute by `factor` from the trigger on (fail-slow)."""
    PAGELOSS = "pageloss"
    """Destroy retained pages (memfd holes) of one protection group, then SIGKILL."""
    OOM = "oom"
    """Fail one device allocation (`torch.OutOfMemoryError` at the trigger, once): what the
    active trainer's allocator reports when the device is full. The trainer asks its agent to
    reclaim the shadows and retries the iteration (Leto §6); without shadows it is a crash."""
    CKPTCORRUPT = "ckptcorrupt"
    """Flip one byte in the middle of the newest complete checkpoint's largest file on disk (bit
    rot, a torn write), then SIGKILL the trainer: the restart must notice the damage and load
    the checkpoint before it."""
    BITFLIP = "bitflip"
    """Flip one byte of this rank's parameters in place (silent data corruption): nothing in
    the runtime detects or repairs it, so the run must come out NOT bit-exact, naming the
    rank — the negative control of the audit."""
    LOSE = "lose"
    """The rank's device is gone for the rest of the job (hardware that does not come back,
    Leto §2.2): recorded lost in the job's device registry (`unbroken.devices`; what a
    GPU probe would report), its state manager shut down so its retained memory is destroyed,
    then SIGKILL the trainer. The agent's health check finds the device lost and never starts
    anything on it again."""
    NODELOSS = "nodeloss"
    """The whole node that runs the rank is gone at once (a host that dies): SIGKILL of its
    agent (`UNBROKEN_AGENT_PID`) and of the trainer; the node's other trainers, shadows and
    state managers die with their agent. The coordinator sees the node's connection close."""
    FLAKY = "flaky"
    """The device is broken but passes its health check: from `iter` on, every trainer on it
    is SIGKILLed at the trigger — the first time, and again in every generation that runs on
    it (a crash loop). Only the first firing is the injected fault; the repeats are the
    hardware's behaviour, which the coordinator must classify as a lost device (issue 18:
    "a device that crash-loops is lost")."""
    MEMSPIKE = "memspike"
    """Allocate and touch `mb` MiB more for the rest of the iteration (a memory peak such as a
    long-sequence batch or uneven expert routing): no failure unless memory runs out."""


class SlowTarget(enum.StrEnum):
    """What a `slow` fault stretches ([Note: slow-fault] in `unbroken.inject.injector`)."""

    COMPUTE = "compute"
    """Every phase step but the gradient all-reduce (forward, backward, protect, sync, update
    chunks, boundary), by the rank's own work in it: the device computes slower."""
    COMM = "comm"
    """Only the gradient all-reduce buckets and, on a plan's rank, its sending p2p batches:
    the rank's link is slower."""


class InjectedFault(RuntimeError):
    """The exception raised by an `exception` fault."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: FaultKind
    rank: int
    iteration: int | None = None
    phase: Phase | None = None
    step: int | None = None
    """Step within the phase (micro-batch or update chunk); None = the middle step."""
    at_s: float | None = None
    """Fire this many seconds after the job's first iteration started (instead of iteration)."""
    factor: float = 1.0
    """`slow`: the stretched steps take `factor` x their healthy time (1.0 with `level`)."""
    level: Level | None = None
    """`slow`: instead of a factor, the severity (weak/medium/severe: ~35/55/70% throughput
    loss, `unbroken.detect.levels`); the injector derives the factor."""
    what: SlowTarget = SlowTarget.COMPUTE
    """`slow`: compute or comm."""
    until: int | None = None
    """`slow`: the device runs at full speed again from this iteration on (None: for the rest
    of the trainer process's life) — a device that recovers, for re-admission. Until then every
    trainer on the device stalls, also one started after the fault fired (`slow_resumed`)."""
    pages: int = 0
    """`pageloss`: data pages of one protection group to destroy."""
    parity: int = 0
    """`pageloss`: first-tier parity pages of the same group to destroy."""
    group: int | None = None
    """`pageloss`: which protection group (default: drawn from the fault's key)."""
    groups: int = 1
    """`pageloss`: how many protection groups lose pages (each `pages` + `parity`)."""
    mb: int = 0
    """`memspike`: MiB allocated (and written) until the iteration ends."""
    over: int = 0
    """`memspike` on a GPU: allocate the device's free memory plus `over` MiB instead of `mb`
    — more than is free, so it succeeds only if at least `over` MiB are reclaimed (a forced
    OOM for the allocation-failure path). The size is fixed when it first fires."""

    @property
    def key(self) -> str:
        """A stable id of this fault within the job (used to fire it once)."""
        return self.text().replace(":", "_").replace(",", "_").replace("=", "")

    def text(self) -> str:
        parts = [f"rank={self.rank}"]
        if self.iteration is not None:
            parts.append(f"iter={self.iteration}")
        if self.phase is not None:
            parts.append(f"phase={self.phase.value}")
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.at_s is not None:
            parts.append(f"at={self.at_s:g}")
        if self.kind is FaultKind.SLOW:
            parts.append(f"level={self.level.value}" if self.level else f"factor={self.factor:g}")
            if self.what is not SlowTarget.COMPUTE:
                parts.append(f"what={self.what.value}")
            if self.until is not None:
                parts.append(f"until={self.until}")
        if self.kind is FaultKind.MEMSPIKE:
            parts.append(f"over={self.over}" if self.over else f"mb={self.mb}")
        if self.kind is FaultKind.PAGELOSS:
            parts.append(f"pages={self.pages}")
            if self.parity:
                parts.append(f"parity={self.parity}")
            if self.group is not None:
                parts.append(f"group={self.group}")
            if self.groups != 1:
                parts.append(f"groups={self.groups}")
        return f"{self.kind.value}:{','.join(parts)}"


def parse_fault(spec: str) -> FaultSpec:
    """Parse "kind:rank=R,iter=I,phase=P" (see the package docstring).

    Raises:
        UserError: with the spec and what is wrong in it.
    """
    kind_s, _, rest = spec.partition(":")
    kind = _parse_kind(spec, kind_s)
    fields = _parse_fields(spec, kind, rest)
    values = _typed_values(spec, fields)
    _check_values(spec, kind, fields, values)
    if values["iteration"] is not None and values["phase"] is None:
        values["phase"] = Phase.FORWARD
    return FaultSpec(kind=kind, **values)


def _parse_kind(spec: str, kind_s: str) -> FaultKind:
    try:
        return FaultKind(kind_s.strip())
    except ValueError:
        raise UserError(
            f"fault {spec!r}: unknown kind {kind_s!r}; choose one of "
            f"{', '.join(k.value for k in FaultKind)}"
        ) from None


def _parse_fields(spec: str, kind: FaultKind, rest: str) -> dict[str, str]:
    """The spec's key=value fields, as strings; a field this kind does not take is an error."""
    fields: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"fault {spec!r}: expected key=value, got {item!r}")
        fields[name.strip()] = value.strip()
    known = {"rank", "iter", "phase", "step", "at", "factor", "pages", "parity", "group", "groups"}
    if kind is FaultKind.SLOW:
        known |= {"level", "what", "until"}
    if kind is FaultKind.MEMSPIKE:
        known |= {"mb", "over"}
    if unknown := set(fields) - known:
        raise UserError(
            f"fault {spec!r}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    return fields


def _typed_values(spec: str, fields: dict[str, str]) -> dict[str, Any]:
    """`FaultSpec`'s fields but `kind`, converted from the spec's strings (defaults filled in)."""
    try:
        return {
            "rank": int(fields["rank"]),
            "iteration": int(fields["iter"]) if "iter" in fields else None,
            "step": int(fields["step"]) if "step" in fields else None,
            "at_s": float(fields["at"]) if "at" in fields else None,
            "factor": float(fields.get("factor", "1")),
            "phase": _choice(fields, "phase", Phase),
            "pages": int(fields.get("pages", "0")),
            "parity": int(fields.get("parity", "0")),
            "group": int(fields["group"]) if "group" in fields else None,
            "groups": int(fields.get("groups", "1")),
            "mb": int(fields.get("mb", "0")),
            "over": int(fields.get("over", "0")),
            "level": _choice(fields, "level", Level),
            "what": _choice(fields, "what", SlowTarget) or SlowTarget.COMPUTE,
            "until": int(fields["until"]) if "until" in fields else None,
        }
    except KeyError:
        raise UserError(f"fault {spec!r}: 'rank=' is required") from None
    except ValueError as exc:
        raise UserError(f"fault {spec!r}: {exc}") from None


def _check_values(spec: str, kind: FaultKind, fields: dict[str, str], v: dict[str, Any]) -> None:
    """The rules across fields: one trigger, what each kind needs, no negative rank or iter."""
    iteration = v["iteration"]
    if (iteration is None) == (v["at_s"] is None):
        raise UserError(f"fault {spec!r}: give exactly one trigger, iter=I or at=SECONDS")
    if kind is FaultKind.PAGELOSS and (v["pages"] + v["parity"] < 1 or v["groups"] < 1):
        raise UserError(f"fault {spec!r}: pageloss needs pages=N and/or parity=N")
    if kind is FaultKind.MEMSPIKE and (v["mb"] < 1) == (v["over"] < 1):
        raise UserError(
            f"fault {spec!r}: memspike needs exactly one of mb=N (MiB, >= 1) or over=N "
            "(MiB beyond the GPU's free memory, >= 1)"
        )
    if kind is FaultKind.SLOW and v["level"] is not None and "factor" in fields:
        raise UserError(f"fault {spec!r}: give factor=F or level=L, not both")
    if kind is FaultKind.SLOW and v["level"] is None and v["factor"] <= 1.0:
        raise UserError(f"fault {spec!r}: slow needs factor > 1 or level=weak|medium|severe")
    if v["until"] is not None and iteration is not None and v["until"] <= iteration:
        raise UserError(f"fault {spec!r}: until must be after iter")
    if v["rank"] < 0 or (iteration is not None and iteration < 0):
        raise UserError(f"fault {spec!r}: rank and iter must be >= 0")


def _choice(fields: dict[str, str], name: str, enum_type: type[enum.StrEnum]):
    """The enum member named by `fields[name]`, None if absent.

    Raises:
        ValueError: with the field, the value and the choices (one line).
    """
    if name not in fields:
        return None
    try:
        return enum_type(fields[name])
    except ValueError:
        choices = "|".join(m.value for m in enum_type)
        raise ValueError(f"{name}={fields[name]!r} is not one of {choices}") from None


_SILENT_KINDS = (FaultKind.OOM, FaultKind.MEMSPIKE)
"""Kinds that log no firing event (they are not failures unless memory runs out)."""


def faults_not_fired(inject: list[str], events: list[dict]) -> list[str]:
    """The scheduled faults (`inject` specs) that never fired in a run — an iteration past the
    run's end, a wall time it never reached — as canonical specs, in schedule order, from the
    run's events (`failure_injected`, `corruption_injected`)."""
    fired = {
        e.get("spec") for e in events if e["kind"] in ("failure_injected", "corruption_injected")
    }
    specs = [parse_fault(s) for s in inject]
    return [f.text() for f in specs if f.kind not in _SILENT_KINDS and f.text() not in fired]
