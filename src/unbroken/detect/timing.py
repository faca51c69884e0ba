"""Per-rank phase timings, recorded by a trainer phase hook, for fail-slow validation.

Validation must say *which* rank is slow. In data-parallel training every rank's iteration time
is the same (all wait at the gradient all-reduce), so only a rank's own compute and
communication times tell the slow one apart. `PhaseTimer` is a `Trainer` hook
(`unbroken.train.phases.PhaseHook`) that stamps the start of each forward/backward micro-batch,
the first ALLREDUCE bucket, REDUCED and PROTECT, which yields:

- (a rank that computes no micro-batch — an empty replica, `unbroken.train.Trainer._probe` —
  gets a record from its first ALLREDUCE on: no `mb_s`, `compute_s` 0, its reduction and wait;)
- `mb_s`: forward+backward of every micro-batch (FORWARD m -> FORWARD m+1; the last one ends at
  the first ALLREDUCE hook). Without that hook (one replica, or a loop that does not fire it)
  the last micro-batch is left out: its end is not stamped before PROTECT, and the all-reduce
  (with the wait for peers) would be mixed in;
- `forward_s`: the forward of every micro-batch (FORWARD m -> BACKWARD m);
- `compute_s`: FORWARD 0 -> last BACKWARD start, pure local compute;
- `comm_s`: first ALLREDUCE -> REDUCED: the gradient all-reduce, with the wait for the slowest
  peer (0 without replicas);
- `reduce_s`: last BACKWARD start -> PROTECT: the last backward plus the all-reduce;
- `mb_cpu_s`: the process CPU time of the same intervals as `mb_s` (a diagnostic: on a shared
  machine it leaves out the time the rank was not scheduled; an injected `slow` sleeps, so it
  does not show there either — detection uses the wall-clock `mb_s`).

What a slowdown looks like here: a compute-slowed rank has long `mb_s` and a short `comm_s` (it
reaches the all-reduce last, nobody waits for it there), its peers a long `comm_s` (they wait).
A comm-slowed rank (`slow ... what=comm`, [Note: slow-fault] in `unbroken.inject.injector`) has
normal `mb_s` and a `comm_s` that holds its stall; its peers' `comm_s` stays healthy and they
wait for it in the next collective (the sync phase's loss all-reduce), outside `comm_s`.

On a GPU the hooks run on the host while kernels run later, so host clock stamps would time the
enqueueing, not the work. With `device` a CUDA device the timer records a CUDA event at each
stamp instead (no synchronization) and turns the events into durations once the iteration's
work is done — at `flush()` (the trainer calls it after each iteration, whose loss all-reduce
has synchronized) or at the next iteration's first hook; an interval then holds the GPU's time
between the two points of the stream, idle gaps included (a host stall that starves the GPU
shows, one hidden behind queued work does not slow anything and does not show).

Put it after the fault injector in the hook list: a `slow` fault stalls inside the injector's
hook call for the phase step that just ended, so the timer's stamp then falls after the stall
and each interval holds its own stall. The timer never sleeps, allocates per iteration only a
small record, and takes no locks; it must never talk to other ranks (gathering is the caller's
choice).

`StageTiming` is the same input for a rank of a hybrid-parallel plan. Phase hooks cannot see
where a plan's rank waits (point-to-point batches, TP collectives inside a layer), so the
engine's worker (`unbroken.engine.PlanWorker`) measures it itself and fills one per iteration:
the duration of every compute action and the split of the iteration into time blocked in
communication with peers and the rest, the rank's own `busy_s`. What a slowdown looks like
there: a slowed rank's busy time grows (its compute, or an injected stall, is its own); its
pipeline neighbours and TP peers wait for it, which lands in their blocked time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from unbroken.train.phases import Phase

__all__ = ["PhaseTimer", "RankTiming", "StageTiming"]


def _minus(a: float, b: float) -> float:
    return b - a


def _elapsed(a, b) -> float:
    """Seconds between two recorded CUDA events."""
    return a.elapsed_time(b) / 1e3


@dataclass(frozen=True, slots=True)
class RankTiming:
    """One rank's timings of one iteration (seconds)."""

    rank: int
    iteration: int
    mb_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    compute_s: float
    reduce_s: float
    comm_s: float = 0.0
    mb_cpu_s: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "iter": self.iteration,
            "mb_s": list(self.mb_s),
            "forward_s": list(self.forward_s),
            "compute_s": self.compute_s,
            "reduce_s": self.reduce_s,
            "comm_s": self.comm_s,
            "mb_cpu_s": list(self.mb_cpu_s),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RankTiming:
        return cls(
            rank=int(d["rank"]),
            iteration=int(d["iter"]),
            mb_s=tuple(d["mb_s"]),
            forward_s=tuple(d["forward_s"]),
            compute_s=float(d["compute_s"]),
            reduce_s=float(d["reduce_s"]),
            comm_s=float(d.get("comm_s", 0.0)),
            mb_cpu_s=tuple(d.get("mb_cpu_s", ())),
        )


@dataclass(frozen=True, slots=True)
class StageTiming:
    """One plan rank's timings of one iteration (seconds), measured by its `PlanWorker`.

    busy_s + p2p_s + tp_s + reduce_s + sync_s is the rank's iteration (`run_iteration`).
    """

    rank: int
    iteration: int
    compute: tuple[tuple[str, int, int, float], ...]
    """(kind "F"/"B"/"W", virtual stage, micro-batch, seconds) of every compute action, in
    order: the action itself (TP collectives inside it included), not the phase hooks before
    it."""
    busy_s: float
    """Time not blocked in communication with peers: compute without its TP collectives,
    phase hooks, the optimizer step's local work."""
    p2p_s: float = 0.0
    """In point-to-point batches (sending, and waiting for what the schedule receives)."""
    p2p_min_s: float = 0.0
    """The shortest point-to-point batch: one that did not wait, about one message's link
    time (0 without batches)."""
    tp_s: float = 0.0
    """In the TP group's collectives inside compute actions (waiting for the slowest member
    included)."""
    reduce_s: float = 0.0
    """REDUCE_GRAD: the gradient reduction across replicas."""
    sync_s: float = 0.0
    """The loss and gradient-norm all-reduce over the world."""
    step_s: float = 0.0
    """OPT_STEP without `sync_s`: protect, update, boundary (local work)."""
    probe: tuple[tuple[str, int, int, float], ...] = ()
    """As `compute`, for the probe micro-batch of a replica that owns none ([Note: probe
    micro-batch] in `unbroken.engine.probe`): no part of the iteration's work, so kept apart
    from `compute` (the plan's fit never sees it); only the recovery check reads it."""

    def to_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "iter": self.iteration,
            "compute": [list(c) for c in self.compute],
            "busy_s": self.busy_s,
            "p2p_s": self.p2p_s,
            "p2p_min_s": self.p2p_min_s,
            "tp_s": self.tp_s,
            "reduce_s": self.reduce_s,
            "sync_s": self.sync_s,
            "step_s": self.step_s,
            "probe": [list(c) for c in self.probe],
        }

    @classmethod
    def from_dict(cls, d: dict) -> StageTiming:
        return cls(
            rank=int(d["rank"]),
            iteration=int(d["iter"]),
            compute=tuple((str(k), int(s), int(m), float(t)) for k, s, m, t in d["compute"]),
            busy_s=float(d["busy_s"]),
            p2p_s=float(d.get("p2p_s", 0.0)),
            p2p_min_s=float(d.get("p2p_min_s", 0.0)),
            tp_s=float(d.get("tp_s", 0.0)),
            reduce_s=float(d.get("reduce_s", 0.0)),
            sync_s=float(d.get("sync_s", 0.0)),
            step_s=float(d.get("step_s", 0.0)),
            probe=tuple((str(k), int(s), int(m), float(t)) for k, s, m, t in d.get("probe", ())),
        )


@dataclass(slots=True)
class PhaseTimer:
    """A phase hook recording this rank's `RankTiming` per iteration.

    Args:
        rank: this trainer's rank (copied into the records).
        on_record: called with each finished record (at the PROTECT hook); records are also
            kept in `records` (the last `keep` of them).
        keep: how many records to keep.
        clock: monotonic clock (tests pass a fake one).
        cpu_clock: this process's CPU time (for `mb_cpu_s`).
        device: the trainer's device; a CUDA device makes the stamps CUDA events (module
            docstring), and a record appears at `flush()`.
    """

    rank: int
    on_record: Callable[[RankTiming], None] | None = None
    keep: int = 64
    clock: Callable[[], float] = time.perf_counter
    cpu_clock: Callable[[], float] = time.process_time
    records: list[RankTiming] = field(default_factory=list)
    _fwd: list[float] = field(default_factory=list)
    _bwd: list[float] = field(default_factory=list)
    _comm: list[float] = field(default_factory=list)
    """Stamps of the first ALLREDUCE and of REDUCED this iteration."""
    _cpu: list[float] = field(default_factory=list)
    """CPU-time stamps of every FORWARD and the first ALLREDUCE."""
    _iteration: int = -1
    device: object = None
    _pending: tuple | None = None
    """CUDA: (stamps, iteration) of a finished iteration whose events are not read yet."""

    @property
    def _cuda(self) -> bool:
        """Whether stamps are CUDA events (the trainer's device is a GPU)."""
        return getattr(self.device, "type", None) == "cuda"

    def _stamp(self):
        if not self._cuda:
            return self.clock()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def flush(self) -> None:
        """Turn a finished iteration's CUDA events into its record (waits for its last event,
        which the iteration's own synchronization has normally passed already)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[-1].synchronize()
            self._record(*pending)

    def __call__(self, phase: Phase, iteration: int, step: int, n_steps: int) -> None:
        if phase is Phase.FORWARD and step == 0:
            self.flush()
        now = self._stamp()
        if phase is Phase.FORWARD:
            if step == 0:
                self._fwd, self._bwd, self._comm, self._cpu = [], [], [], []
                self._iteration = iteration
            self._fwd.append(now)
            self._cpu.append(self.cpu_clock())
        elif phase is Phase.BACKWARD:
            self._bwd.append(now)
        elif phase is Phase.ALLREDUCE and step == 0:
            if iteration != self._iteration:  # no micro-batch this iteration: an empty replica
                self.flush()
                self._fwd, self._bwd, self._comm, self._cpu = [], [], [], []
                self._iteration = iteration
            self._comm.append(now)
            self._cpu.append(self.cpu_clock())
        elif phase is Phase.REDUCED:
            self._comm.append(now)
        elif phase is Phase.PROTECT and iteration == self._iteration and (self._bwd or self._comm):
            self._finish(now)

    def _finish(self, now) -> None:
        stamps = (self._fwd, self._bwd, self._comm, self._cpu, self._iteration, now)
        self._iteration = -1
        if self._cuda:
            self._pending = stamps  # read once the GPU has done the work (flush)
        else:
            self._record(*stamps)

    def _record(self, f: list, b: list, c: list, cpu: list, iteration: int, now) -> None:
        dt = _elapsed if self._cuda else _minus
        n = min(len(f), len(b))
        ends = [*f[1:n], c[0]] if c else f[1:n]
        cpu = cpu[: len(ends) + 1]  # FORWARD stamps, then the first ALLREDUCE's
        rec = RankTiming(
            rank=self.rank,
            iteration=iteration,
            mb_s=tuple(dt(s, e) for s, e in zip(f, ends, strict=False)),
            forward_s=tuple(dt(f[m], b[m]) for m in range(n)),
            compute_s=dt(f[0], b[n - 1]) if n else 0.0,
            reduce_s=dt(b[n - 1] if n else c[0], now),
            comm_s=dt(c[0], c[-1]) if c else 0.0,
            mb_cpu_s=tuple(b - a for a, b in itertools.pairwise(cpu)),
        )
        self.records.append(rec)
        del self.records[: -self.keep]
        if self.on_record is not None:
            self.on_record(rec)
