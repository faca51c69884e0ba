"""Discrete-event simulation of a training run under failures (issue 4, item 3).

Owns the event-by-event replay of a policy: iterations of (1 + omega) T_iter, blocking checkpoint
saves of T_ckpt every I iterations that become restorable `usable_lag` iterations later, failures
from a Poisson process or a trace, recoveries of T_det + T_init, rollback to the newest usable
checkpoint where the policy rolls back, and failures that arrive during another recovery (which
restart it). Lost work is not an input here: it follows from where each failure lands.

Between two events the run is deterministic, so the simulator jumps from failure to failure with
closed arithmetic on the iteration/checkpoint schedule instead of stepping iterations; a run of
10^5 failures takes about a second.

[Note: ETTR measurement] As in Leto §8.1, ETTR = T_ref(i) / T_eval(i) = i * T_iter / elapsed,
where i is the progress (committed iterations) at the end of the run. A horizon run measures at
the horizon; a target run (validation) stops when iteration `target_iters` completes.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from unbroken.errors import UserError
from unbroken.sim.policy import KINDS, FailureMix, PolicyTerms

__all__ = [
    "DesResult",
    "Failure",
    "IterFailure",
    "RunStats",
    "replay_iterations",
    "simulate",
    "simulate_once",
]

# Two-sided 95% Student-t quantiles for 1..30 degrees of freedom; 1.96 beyond.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure: when (seconds since the run's first iteration started) and which kind."""

    t_s: float
    """Seconds since the first iteration started."""
    kind: str
    """hof, fatal or fail-slow."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"unknown failure kind {self.kind!r} (known: {', '.join(KINDS)})")


@dataclass(frozen=True, slots=True)
class IterFailure:
    """A failure keyed by progress instead of time, as the runtime's injector fires them: the
    first time iteration `iteration` (1-based: the iteration that would complete progress
    `iteration`) has run for `fraction` of its time."""

    iteration: int
    """1-based iteration in flight."""
    fraction: float
    """How far into it, in [0, 1]."""
    kind: str
    """hof, fatal or fail-slow."""
    keeps_in_flight: bool = False
    """The iteration's elapsed work survives recovery (in-place recovery of a failure after
    the gradients were protected: RMU finishes the interrupted update, Leto §5)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"unknown failure kind {self.kind!r} (known: {', '.join(KINDS)})")
        if self.iteration < 1 or not 0.0 <= self.fraction <= 1.0:
            raise UserError("an iteration-keyed failure needs iteration >= 1, fraction in [0, 1]")


@dataclass(kw_only=True, slots=True)
class RunStats:
    """What one replication measured."""

    ettr: float
    """Progress * T_iter / elapsed ([Note: ETTR measurement])."""
    iterations: int
    """Progress (committed iterations) at the end."""
    wall_s: float
    """Elapsed simulated time."""
    failures: dict[str, int]
    """Failures by kind."""
    overlapping: int
    """Failures that arrived during another recovery."""
    lost_iters: float
    """Mean lost work per crash, iterations (completed ones rolled back + the in-flight part)."""
    recovering_s: float
    """Time spent in detection + initialization."""
    lost_each: list[float] = field(default_factory=list)
    """Lost work of each crash in order, iterations."""


@dataclass(kw_only=True, slots=True)
class DesResult:
    """Discrete-event ETTR over one or more replications."""

    ettr: float
    """Mean ETTR over replications."""
    ci95: tuple[float, float] | None
    """95% confidence interval of the mean (Student t over replications); None for a single
    deterministic (trace) run."""
    replications: int
    """Independent runs."""
    failures: dict[str, int]
    """Failures by kind, summed over replications."""
    overlapping: int
    """Failures that arrived while another recovery was in progress."""
    mean_lost_iters: float
    """Observed lost work per crash failure, iterations (compare with L)."""
    wall_s: float
    """Simulated elapsed time, summed over replications."""
    runs: list[RunStats] = field(default_factory=list)
    """Each replication's measurements."""


class _Schedule:
    """The deterministic timeline from a restart: iterations j0+1, j0+2, ... with a blocking
    checkpoint after every iteration that is a multiple of I (and one at j0 when `first_ckpt`)."""

    __slots__ = ("a", "c", "first_ckpt", "interval", "j0", "pauses", "t0")

    def __init__(self, t0: float, j0: int, a: float, c: float, interval: int, first: bool):
        self.t0, self.j0, self.a, self.c, self.interval = t0, j0, a, c, interval
        self.first_ckpt = first
        self.pauses: list[tuple[float, float]] = []  # (from time, delay), in time order

    def _ckpts_between(self, lo: int, hi: int) -> int:
        """Checkpoints after iterations in (lo, hi]."""
        if not self.interval or hi <= lo:
            return 0
        return hi // self.interval - lo // self.interval

    def end(self, k: int) -> float:
        """Completion time of iteration k >= j0."""
        if k <= self.j0:
            return self.t0
        base = self.t0 + (self.c if self.first_ckpt else 0.0)
        end = base + (k - self.j0) * self.a + self.c * self._ckpts_between(self.j0, k - 1)
        for start, delay in self.pauses:
            if end > start:
                end += delay
        return end

    def completed(self, t: float) -> int:
        """Largest k >= j0 with end(k) <= t."""
        lo, hi = self.j0, self.j0 + max(1, math.ceil((t - self.t0) / self.a)) + 1
        # end(k) >= t0 + (k - j0) a, so no k above hi can be complete by t.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.end(mid) <= t:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def ckpt_done(self, m: int) -> float:
        """When the checkpoint after iteration m (m = j0 or a multiple of I) finishes."""
        return self.end(m) + self.c


class _Replay:
    """One replication: consumes failures in time order and tracks progress."""

    def __init__(self, terms: PolicyTerms, rec_slow: tuple[float, float]):
        self.terms = terms
        self.a = (1.0 + terms.omega) * terms.t_iter_s
        self.c = terms.t_ckpt_s if terms.interval else 0.0
        self.interval = terms.interval
        self.lag = terms.usable_lag
        self.slow_detect_s, self.slow_factor = rec_slow
        self.sched = _Schedule(0.0, 0, self.a, self.c, self.interval, False)
        self.last_usable = 0  # the initial state is restorable
        self.failures = dict.fromkeys(KINDS, 0)
        self.overlapping = 0
        self.lost = 0.0
        self.lost_each: list[float] = []
        self.crashes = 0
        self.recovering = 0.0

    def progress(self, t: float) -> int:
        """Committed iterations at time t (the restart point while recovering)."""
        if t < self.sched.t0:
            return self.sched.j0
        return self.sched.completed(t)

    def _crash(self, t: float, kind: str, keeps_in_flight: bool = False) -> None:
        cost = self.terms.costs[kind]
        s = self.sched
        recovering = t < s.t0
        if recovering:
            self.overlapping += 1
            self.recovering -= s.t0 - t  # the interrupted recovery ends now
            j, taken, usable = s.j0, -1, -1
        else:
            j = s.completed(t)
            taken, usable = self._checkpoints(t, j)
        self.last_usable = max(self.last_usable, usable)
        if cost.rollback:
            j_new, first = self.last_usable, False
        else:
            # In place: retained state survives and a checkpoint whose save finished completes
            # its transfer during recovery; one interrupted mid-save is taken again.
            self.last_usable = max(self.last_usable, taken)
            j_new = j
            due = bool(self.interval) and j > 0 and j % self.interval == 0
            first = due and j > self.last_usable
        in_flight = 0.0 if recovering else (t - (s.end(j + 1) - self.a)) / self.a
        in_flight = min(1.0, max(0.0, in_flight))
        kept = 0.0
        if keeps_in_flight and not cost.rollback and not recovering:
            kept, in_flight = in_flight * self.a, 0.0
        lost = (j - j_new) + in_flight
        self.lost += lost
        self.lost_each.append(lost)
        self.crashes += 1
        rec = cost.detect_s + cost.init_s
        self.recovering += rec
        # A kept in-flight iteration resumes where it stopped: its end moves back by the work
        # already done (the segment starts "earlier" by that much, never before now).
        start = max(t + rec - kept, t) if kept else t + rec
        self.sched = _Schedule(start, j_new, self.a, self.c, self.interval, first)

    def _checkpoints(self, t: float, j: int) -> tuple[int, int]:
        """The newest checkpoint saved by time t in the current segment, and the newest one
        that is restorable (saved and `lag` iterations old); -1 for none."""
        s = self.sched
        first_done = s.first_ckpt and s.t0 + self.c <= t
        taken = s.j0 if first_done else -1
        usable = s.j0 if first_done and s.j0 + self.lag <= j else -1
        if self.interval:
            step = self.interval
            newest = (j // step) * step
            if newest > s.j0:
                # Saves after iterations < j finished before iteration j started.
                done = newest < j or s.ckpt_done(newest) <= t
                taken = newest if done else (newest - step if newest - step > s.j0 else taken)
            old_enough = ((j - self.lag) // step) * step
            if old_enough > s.j0 and (old_enough < j or s.ckpt_done(old_enough) <= t):
                usable = old_enough
        return taken, usable

    def fail_slow(self, t: float) -> float:
        """A straggler joins: the run continues at 1/factor speed until it is evicted.

        Returns:
            The eviction time (when the caller must inject the crash).
        """
        # Work finished before t keeps its time; everything after is delayed by the work the
        # slowed window loses, (1 - 1/factor) of it: the window as a pause of equal cost.
        delay = self.slow_detect_s * (1.0 - 1.0 / self.slow_factor)
        self.sched.pauses.append((max(t, self.sched.t0), delay))
        return t + self.slow_detect_s

    def handle(self, t: float, kind: str, keeps_in_flight: bool = False) -> float | None:
        """Apply a failure at t (kind "evict" is a fail-slow's eviction, not a new failure).

        Returns:
            For fail-slow, when its eviction is due; else None.
        """
        if kind == "evict":
            self._crash(t, "fail-slow")
            return None
        self.failures[kind] += 1
        if kind == "fail-slow":
            return self.fail_slow(t)
        self._crash(t, kind, keeps_in_flight)
        return None


def _events(
    mix: FailureMix | None, trace: Iterable[Failure] | None, rng: np.random.Generator
) -> Iterable[Failure]:
    if trace is not None:
        yield from sorted(trace, key=lambda f: f.t_s)
        return
    assert mix is not None
    kinds = list(mix.fractions)
    probs = np.array([mix.fractions[k] for k in kinds])
    t = 0.0
    while True:
        t += rng.exponential(mix.mttf_s)
        yield Failure(t, kinds[int(rng.choice(len(kinds), p=probs))])


# Long: an 18-line docstring and an 11-line signature; the body is 38 lines.
def simulate_once(
    terms: PolicyTerms,
    *,
    mix: FailureMix | None = None,
    trace: Iterable[Failure] | None = None,
    horizon_s: float | None = None,
    target_iters: int | None = None,
    seed: int = 0,
    slow: tuple[float, float] = (60.0, 2.0),
    progress: Callable[[float], None] | None = None,
) -> RunStats:
    """Replay one run.

    Args:
        terms: the policy's terms (iteration time, checkpoints, costs per failure kind).
        mix: failure process (Poisson with rate 1/MTTF and kind probabilities); or
        trace: explicit failures (times relative to the first iteration's start).
        horizon_s: stop at this elapsed time; or
        target_iters: stop when this iteration completes.
        seed: random seed for the Poisson process.
        slow: (detection window s, slowdown factor) for fail-slow failures.
        progress: called with the fraction done from time to time.

    Returns:
        The run's measurements; see [Note: ETTR measurement].

    Raises:
        UserError: neither or both of mix/trace, or neither stop condition.
    """
    if (mix is None) == (trace is None):
        raise UserError("give exactly one of a failure mix (Poisson) or a trace")
    if horizon_s is None and target_iters is None:
        raise UserError("give a horizon or a target iteration count")
    replay = _Replay(terms, slow)
    rng = np.random.default_rng(seed)
    pending: list[tuple[float, int, str]] = []  # follow-up evictions
    source = iter(_events(mix, trace, rng))
    nxt = next(source, None)
    seq = 0
    last_report = time.monotonic()
    while True:
        if pending and (nxt is None or pending[0][0] <= nxt.t_s):
            t, _, kind = heapq.heappop(pending)
            from_source = False
        elif nxt is not None:
            t, kind = nxt.t_s, nxt.kind
            from_source = True
        else:
            t, kind, from_source = math.inf, "", False
        if target_iters is not None and target_iters >= replay.sched.j0:
            done_at = replay.sched.end(target_iters)
            if done_at <= t:
                return _stats(replay, target_iters, done_at, terms)
        if horizon_s is not None and t > horizon_s:
            j = replay.progress(horizon_s)
            return _stats(replay, j, horizon_s, terms)
        if math.isinf(t):
            raise UserError("the trace ends before the target iteration can be reached")
        if from_source:
            nxt = next(source, None)
        follow = replay.handle(t, kind)
        if follow is not None:
            seq += 1
            heapq.heappush(pending, (follow, seq, "evict"))
        if progress is not None and time.monotonic() - last_report > 1.0:
            last_report = time.monotonic()
            total = horizon_s if horizon_s is not None else math.inf
            progress(min(1.0, t / total) if math.isfinite(total) else 0.0)


def _stats(replay: _Replay, iters: int, wall: float, terms: PolicyTerms) -> RunStats:
    return RunStats(
        ettr=iters * terms.t_iter_s / wall if wall > 0 else 0.0,
        iterations=iters,
        wall_s=wall,
        failures=dict(replay.failures),
        overlapping=replay.overlapping,
        lost_iters=replay.lost / replay.crashes if replay.crashes else 0.0,
        recovering_s=replay.recovering,
        lost_each=list(replay.lost_each),
    )


# Long: a 14-line docstring and a 10-line signature; the body is 38 lines.
def simulate(
    terms: PolicyTerms,
    mix: FailureMix,
    *,
    horizon_s: float,
    replications: int = 10,
    seed: int = 0,
    slow: tuple[float, float] = (60.0, 2.0),
    progress: Callable[[str], None] | None = None,
) -> DesResult:
    """Poisson-mode ETTR over independent replications, with a 95% confidence interval.

    Args:
        terms: the policy's terms.
        mix: MTTF and failure-kind probabilities.
        horizon_s: simulated elapsed time of each replication.
        replications: independent runs (>= 2 for an interval).
        seed: base seed; replication r uses seed + r.
        slow: (detection window s, slowdown factor) for fail-slow failures.
        progress: receives one-line progress messages.

    Raises:
        UserError: replications < 1 or horizon <= 0.
    """
    if replications < 1 or not horizon_s > 0:
        raise UserError("replications must be >= 1 and the horizon > 0")
    runs = []
    for r in range(replications):

        def tick(frac: float, r: int = r) -> None:
            if progress is not None:
                progress(f"{terms.policy}: replication {r + 1}/{replications} {frac:.0%}")

        runs.append(
            simulate_once(
                terms, mix=mix, horizon_s=horizon_s, seed=seed + r, slow=slow, progress=tick
            )
        )
        if progress is not None:
            progress(f"{terms.policy}: replication {r + 1}/{replications} done")
    values = np.array([run.ettr for run in runs])
    mean = float(values.mean())
    ci = None
    if replications >= 2:
        df = replications - 1
        q = _T95[df - 1] if df <= len(_T95) else 1.96
        half = q * float(values.std(ddof=1)) / math.sqrt(replications)
        ci = (mean - half, mean + half)
    failures = dict.fromkeys(KINDS, 0)
    for run in runs:
        for k, v in run.failures.items():
            failures[k] += v
    crashes = [run.lost_iters for run in runs if run.lost_iters]
    return DesResult(
        ettr=mean,
        ci95=ci,
        replications=replications,
        failures=failures,
        overlapping=sum(run.overlapping for run in runs),
        mean_lost_iters=float(np.mean(crashes)) if crashes else 0.0,
        wall_s=sum(run.wall_s for run in runs),
        runs=runs,
    )


def replay_iterations(
    terms: PolicyTerms, failures: Iterable[IterFailure], target_iters: int
) -> RunStats:
    """Replay a run whose failures are keyed by (iteration, fraction), each firing once, the
    first time the run reaches that point (also after a rollback), until `target_iters`
    complete. This is how `--validate` replays a real run's injection schedule.
    """
    replay = _Replay(terms, (0.0, 1.0))
    pending = sorted(failures, key=lambda f: (f.iteration, f.fraction))
    while True:
        s = replay.sched
        best: tuple[float, int] | None = None
        for idx, f in enumerate(pending):
            if f.iteration <= s.j0:
                continue  # that iteration is behind the restart point; it may come back
            t = s.end(f.iteration) - replay.a + f.fraction * replay.a
            if best is None or t < best[0]:
                best = (t, idx)
        done_at = s.end(target_iters) if target_iters > s.j0 else s.t0
        if best is None or done_at <= best[0]:
            return _stats(replay, target_iters, done_at, terms)
        t, idx = best
        f = pending.pop(idx)
        replay.handle(t, f.kind, f.keeps_in_flight)
