"""The run's summary as a typed value: what `unbroken.run_job` returns.

`RunSummary` holds exactly the fields of `summary.json` (docs/outputs.md), typed: the nested
rows are frozen dataclasses (`RunStats`, `RecoveryBreakdown`, `FailSlowReport`, ...), lists are
tuples. `to_dict()` gives back the JSON form unchanged — same keys, same order, the reference
run's keys only when there was one — and `from_dict` rejects a key it does not know, so the
two forms cannot drift apart silently.

It is also a read-only `Mapping` over `to_dict()`, so code written against the summary dict
(`summary["bit_exact"]`, `summary.get("ettr")`) keeps working; new code reads attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from unbroken.metrics.analysis import RecoveryBreakdown

__all__ = ["FailSlowReport", "IterationRanks", "RunStats", "RunSummary", "SlowInjected"]


@dataclass(frozen=True, slots=True)
class RunStats:
    """One run's figures (`summary.json` "reference" and "faulty")."""

    iterations: int
    wall_s: float
    mean_iter_s: float
    final_loss: float | None
    tokens_per_s: float
    attempts: int


@dataclass(frozen=True, slots=True)
class FailSlowReport:
    """A slow rank (or the sync stage: rank None) the fail-slow watch reported."""

    what: str
    rank: int | None
    stage: int | None
    factor: float
    since_iter: int
    detected_at: int


@dataclass(frozen=True, slots=True)
class SlowInjected:
    rank: int
    iter: int
    spec: str


@dataclass(frozen=True, slots=True)
class IterationRanks:
    """Ranks whose state differs at an iteration (replica or per-rank audit mismatches)."""

    iter: int
    ranks: tuple[int, ...]


_NESTED: dict[str, Any] = {
    "recoveries": RecoveryBreakdown,
    "fail_slow": FailSlowReport,
    "slow_injected": SlowInjected,
    "replica_mismatches": IterationRanks,
    "per_rank_mismatches": IterationRanks,
}
_WITH_REFERENCE = (
    "reference_state_hash",
    "ettr",
    "reference",
    "reference_wall_s",
    "bit_exact",
    "rank_mismatches",
    "per_iteration_mismatches",
    "per_rank_mismatches",
)
"""Keys `summary.json` has only when the job ran its fault-free reference."""


@dataclass(frozen=True, slots=True)
class RunSummary(Mapping[str, Any]):
    """The summary of a job (docs/outputs.md, `summary.json`), as `run_job` returns it."""

    state: str
    reason: str
    final_state_hash: str | None
    failures_injected: int
    failures_detected: int
    faults_not_fired: tuple[str, ...]
    failures_recovered: int
    recoveries: tuple[RecoveryBreakdown, ...]
    faulty: RunStats
    faulty_wall_s: float
    iterations: int
    ckpt_interval: int
    ckpt_cost_s: float
    checkpoints_saved: int
    mean_iter_s: float
    mttf_s: float
    world_size: int
    recovery_mode: str
    fail_slow: tuple[FailSlowReport, ...]
    slow_injected: tuple[SlowInjected, ...]
    change_points: int
    replica_mismatches: tuple[IterationRanks, ...]
    reference_state_hash: str | None = None
    ettr: float | None = None
    reference: RunStats | None = None
    reference_wall_s: float | None = None
    bit_exact: bool | None = None
    """None without a reference run (nothing to compare with)."""
    rank_mismatches: tuple[int, ...] | None = None
    per_iteration_mismatches: tuple[int, ...] | None = None
    per_rank_mismatches: tuple[IterationRanks, ...] | None = None
    replans: tuple[dict[str, Any], ...] = ()
    """The run's re-plans (`unbroken.metrics.replans`; only when it made some)."""
    replans_skipped: tuple[dict[str, Any], ...] = ()
    """Re-plan triggers not acted on, with the reason (only when there were some)."""
    replays: tuple[dict[str, Any], ...] = ()
    """Plan changes that changed the job's bits, which the fault-free reference replayed
    (`unbroken.metrics.replay`; only when there were some): the audit's reference from each
    on, and `reference_state_hash` the last replay's."""
    launch_reference_state_hash: str | None = None
    """With `replays`: the final hash of the reference on the launch plan alone."""
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        """The job finished, every detected failure was recovered, every scheduled fault fired
        and, with a reference, the final state is bit-identical to it."""
        return (
            self.state == "done"
            and self.failures_recovered == self.failures_detected
            and not self.faults_not_fired
            and self.bit_exact is not False
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSummary:
        """The typed summary of a `summary.json` dict.

        Raises:
            ValueError: a key this type does not know (or a required one missing).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"summary keys not in RunSummary: {unknown}")
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in _NESTED and value is not None:
                value = tuple(_row(_NESTED[key], v) for v in value)
            elif key in ("faulty", "reference") and value is not None:
                value = RunStats(**value)
            elif isinstance(value, list):
                value = tuple(value)
            values[key] = value
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"summary is incomplete: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`summary.json`), key for key."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _WITH_REFERENCE and self.reference is None:
                continue
            if not value and f.name in (
                "run_dir",
                "replans",
                "replans_skipped",
                "replays",
                "launch_reference_state_hash",
            ):
                continue
            out[f.name] = _plain(value)
        return out

    # -- read-only mapping over to_dict() -------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def _row(cls: Any, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    if cls is IterationRanks:
        return IterationRanks(iter=value["iter"], ranks=tuple(value["ranks"]))
    return cls(**value)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
