"""The soak's verdicts, as pure functions of its records (samples, metrics rows, recoveries):
leak slopes, steady iteration time, recovery time over the run. No process, no torch.

[Note: soak bounds] Each resource must not grow with the number of recoveries. Per group of
process classes (`unbroken.bench.soak_watch`: the coordinator, the agent, the state managers,
the trainers and shadows together — a promoted shadow trains on as a child of the fork server,
so processes move from one class to the other over the first recoveries —, zombies, and all
of them) and resource, the samples taken while no recovery was in progress are grouped by the
recoveries finished so far, each group reduced to its median (a group's samples are the same
steady state; the median drops a sample caught mid-spawn), and a least-squares line is fitted
through (recoveries, median). The bound on its slope, per recovery:

- fds 0.5, memfds 0.25, threads 0.5, processes 0.1, zombies 0.1: these are counts, steady
  between recoveries; a leak of one per recovery (an fd, a memfd segment, a thread left
  running — a heartbeat, a process group's — a zombie shadow per generation) gives a slope of 1, and the steady level is the same after every recovery, so
  the fitted slope of a leak-free run is ~0;
- RSS 2 MiB per class (a class sums 4 processes or more): RSS drifts with the allocator and
  with which shadow was promoted, a few MiB up or down; a leaked copy of a rank's retained
  state (the demo's small model holds several MiB per rank) or a growing per-generation table
  would exceed it over tens of recoveries;
- shared memory 1 MiB per class: retained state lives in memfds of fixed size per rank; a
  segment not released per generation is at least one page group (tens of KiB to MiB) per
  recovery;
- GPU memory in use on the job's devices (a GPU job only: NVML's device total, the `device`
  check) 2 MiB per recovery: retained state is held in 2 MiB allocations of fixed number per
  rank, and CUDA hands out memory in 2 MiB granules, so a buffer a promoted shadow keeps, a
  context never destroyed or a page not freed per generation adds at least 2 MiB per
  recovery, while every generation's caching allocator settles at the same reserve.
Like with like: a node that returns (or a spare) runs fresh trainers until the next recovery
promotes shadows again, and a fresh trainer holds other memory and fds than a promoted shadow.
For everything but the process count only the recovery counts whose samples mostly hold the
run's usual number of fresh trainers enter the fit, and of those only such samples
(`group_medians`); the process counts are fitted over every steady sample, so a leak of
processes still changes what is fitted. Samples while the job runs on fewer devices than it
launched with (`degraded`: a lost node not back yet) are not steady.
The samples before the first recovery are left out: they hold the job's start-up (its
shadows are forked and initialized over the first ~20 s on the 2-core VM, adding ~150 fds),
not a steady state. A slope needs at least 4 groups (recovery counts 1, 2, ...); with fewer the
check reports "too few".
The coordinator also keeps every event and metrics row of the run in memory by design (the
summary is built from them): growth per iteration, which is far below 2 MiB per recovery at
one failure per 10-30 s.

The coordinator's own load (`coordinator_stats` events, `unbroken.launch.coordinator.load`):
- job-store keys per recovery, fitted like a resource: at most `STORE_KEYS_BOUND`. Every
  generation rendezvouses under its own prefix; keys that outlive their generation pile up
  with the recoveries. The injected faults' fired-markers (one per scheduled fault, kept so a
  redone iteration does not fire its fault again) are not counted: they follow the schedule,
  not the recoveries;
- message handling time: the median of the windows' per-message p50 in the first and last tenth
  of the windows, at most `HANDLE_TOLERANCE` above (sub-millisecond figures on a shared VM:
  only a doubling is a trend, not noise).

Timing checks (one-sided: the soak looks for decay, a faster end is not a failure):
- steady iteration time: the median of `iter_s - ckpt_s` of the iterations in the first and
  in the last tenth of the run, leaving out every iteration from one before a failure to
  `settle` after it, recomputed attempts, and the stretch a `slow` fault was active;
- recovery time: each fail-stop failure's detection plus restart (`detect_s + init_s`: from
  the fault to the first iteration running again) divided by the median of its kind's and
  recovery mode's (a hang waits for the heartbeat timeout, a kill does not; a checkpoint
  fallback loads a checkpoint), then the median of those ratios in the first and in the last
  tenth of the failures (at least 3 each). Recomputation is left out of it: it redoes the
  part of an iteration the fault destroyed, so it follows the phase the fault hit (0 s in
  the update, most of an iteration in the boundary's next forward) and the iteration time,
  which the steady-iteration check already watches; its ratio is reported, not bounded.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BOUNDS",
    "HANDLE_TOLERANCE",
    "STORE_KEYS_BOUND",
    "Check",
    "coordinator_checks",
    "ends_ratio",
    "fit_slope",
    "leak_checks",
    "recompute_s",
    "recovery_ratio",
    "restart_s",
    "smaller_world",
    "stats_points",
    "steady_iterations",
    "with_recoveries",
]

BOUNDS = {
    "fds": 0.5,
    "memfds": 0.25,
    "threads": 0.5,
    "procs": 0.1,
    "rss_mib": 2.0,
    "shmem_mib": 1.0,
}
"""Largest slope per recovery allowed, per class and resource ([Note: soak bounds])."""

GPU_BOUND_MIB = 2.0
"""Largest slope per recovery of the GPU memory in use ([Note: soak bounds])."""

MIN_GROUPS = 4


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict of the soak: a PASS/FAIL line and a JSON row."""

    name: str
    passed: bool | None
    """None: could not be decided (too little data); not a pass."""
    value: Any
    bound: Any
    detail: str = ""

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        return (
            f"{verdict}  {self.name:34} {self.value!s:>14}  bound {self.bound!s:<10} {self.detail}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "passed": self.passed,
            "value": self.value,
            "bound": self.bound,
            "detail": self.detail,
        }


def fit_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than 2 distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx


def _value(row: dict[str, Any], classes: Sequence[str], resource: str) -> float:
    if resource == "gpu_mib":  # the devices' total, whatever the classes
        return float(row["gpu"]["used_mib"])
    key = {"rss_mib": "rss_kib", "shmem_mib": "shmem_kib"}.get(resource, resource)
    total = sum(row["classes"][c].get(key, 0) for c in classes)  # (older rows: no threads)
    return total / 1024 if key != resource else float(total)


def _fresh_trainers(row: dict[str, Any]) -> int:
    return row["classes"]["trainer"]["procs"]


def group_medians(
    samples: Iterable[dict[str, Any]], classes: Sequence[str], resource: str
) -> list[tuple[int, float]]:
    """(recoveries so far, median of the steady samples) per recovery count, of `resource`
    summed over `classes`. Steady: no recovery in progress, and the job on every device it
    launched with (a lost node's processes are gone until it returns: fewer, not a leak).

    Like with like for everything but the process count: only the recovery counts whose
    samples mostly hold the run's most common number of fresh trainers, and of those only
    such samples (a sample taken as a fault struck, before its detection was logged, holds a
    passing set of processes). After an in-place recovery every rank is a promoted
    shadow (a fork of the node's fork server); after a node returns, its ranks are fresh
    trainers until the next recovery promotes shadows again, and a fresh trainer holds other
    memory and fds than a promoted shadow (measured: +100 MiB for two on the demo job). A
    5-minute soak with two node returns among 11 recoveries fitted +3.6 MiB per recovery from
    that alone. The process counts are fitted over every steady sample: a leak of processes
    changes the composition itself."""
    steady = [r for r in samples if not r["in_recovery"] and not r.get("degraded")]
    by_count: dict[int, list[dict[str, Any]]] = {}
    for row in steady:
        by_count.setdefault(row["recoveries"], []).append(row)
    if resource != "procs" and steady:
        later = [r for r in steady if r["recoveries"] >= 1] or steady  # not the start-up's
        fresh = _mode(_fresh_trainers(r) for r in later)
        by_count = {
            k: [r for r in rows if _fresh_trainers(r) == fresh]
            for k, rows in by_count.items()
            if _mode(_fresh_trainers(r) for r in rows) == fresh
        }
    return [
        (k, statistics.median(_value(r, classes, resource) for r in rows))
        for k, rows in sorted(by_count.items())
    ]


def _mode(values: Iterable[int]) -> int:
    """The most common value (the smallest of those tied: a tie is decided the same way on
    every run)."""
    counts = Counter(values)
    top = max(counts.values())
    return min(v for v, n in counts.items() if n == top)


def leak_checks(
    samples: list[dict[str, Any]], groups_of: Mapping[str, Sequence[str]]
) -> list[Check]:
    """One check per group of classes and resource ([Note: soak bounds]); the `zombie` group is
    checked for its process count only; samples with GPU figures add the devices' memory in
    use (`leak device.gpu_mib/recovery`)."""
    checks = []
    for cls, classes in groups_of.items():
        resources = ("procs",) if cls == "zombie" else tuple(BOUNDS)
        for resource in resources:
            groups = group_medians(samples, classes, resource)
            checks.append(_slope_check(f"leak {cls}.{resource}/recovery", groups, BOUNDS[resource]))
    if any("gpu" in r for r in samples):
        groups = group_medians([r for r in samples if "gpu" in r], (), "gpu_mib")
        checks.append(_slope_check("leak device.gpu_mib/recovery", groups, GPU_BOUND_MIB))
    return checks


def _slope_check(name: str, groups: list[tuple[int, float]], bound: float) -> Check:
    """The fitted slope per recovery of (recoveries, median) groups after the first recovery."""
    groups = [g for g in groups if g[0] >= 1]
    slope = fit_slope(groups) if len(groups) >= MIN_GROUPS else None
    if slope is None:
        return Check(name, None, "-", bound, f"too few ({len(groups)} groups)")
    first, last = groups[0][1], groups[-1][1]
    return Check(
        name,
        slope < bound,
        round(slope, 4),
        bound,
        f"{first:.1f} -> {last:.1f} over {groups[-1][0]} recoveries",
    )


def disturbed(failures: Sequence[tuple[int, str]], last_iteration: int, settle: int) -> set[int]:
    """Iterations whose time a failure shapes: from one before each (iteration, kind) to
    `settle` after it, and a `slow` fault's stretch up to `settle` after the next failure."""
    out: set[int] = set()
    ordered = sorted(failures)
    for i, (it, kind) in enumerate(ordered):
        end = it + settle
        if kind == "slow":
            end = (ordered[i + 1][0] if i + 1 < len(ordered) else last_iteration) + settle
        out.update(range(max(0, it - 1), end + 1))
    return out


def smaller_world(metrics: Sequence[dict[str, Any]], world: int, settle: int) -> set[int]:
    """Iterations run on fewer than `world` ranks (a lost device or node not yet back; read
    from the rows' `rank_hashes`), and `settle` after each such stretch."""
    out: set[int] = set()
    small = sorted(
        m["iter"] for m in metrics if m.get("rank_hashes") and len(m["rank_hashes"]) < world
    )
    for it in small:
        out.update(range(it, it + settle + 1))
    return out


def steady_iterations(
    metrics: Sequence[dict[str, Any]],
    failures: Sequence[tuple[int, str]],
    settle: int,
    world: int = 0,
) -> list[tuple[int, float]]:
    """(iteration, seconds without checkpointing) of the steady iterations, in order: each
    iteration's only attempt (a recomputed one is left out), outside `disturbed` and
    `smaller_world` (`world`: the launch world; 0 = not checked), not the first two
    (start-up)."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    for m in metrics:
        attempts.setdefault(m["iter"], []).append(m)
    last = max(attempts, default=0)
    skip = disturbed(failures, last, settle) | smaller_world(metrics, world, settle)
    return [
        (it, rows[0]["iter_s"] - (rows[0].get("ckpt_s") or 0.0))
        for it, rows in sorted(attempts.items())
        if len(rows) == 1 and it not in skip and it >= 2
    ]


def ends_ratio(values: Sequence[float], fraction: float = 0.1, minimum: int = 3):
    """(median of the first `fraction`, of the last, last / first) of `values`, each end at
    least `minimum` values; None if there are fewer than 2 x `minimum`."""
    if len(values) < 2 * minimum:
        return None
    n = max(minimum, int(len(values) * fraction))
    n = min(n, len(values) // 2)
    first, last = statistics.median(values[:n]), statistics.median(values[-n:])
    return first, last, last / first if first else None


def cpu_ends(samples: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per process class, the median cores it used over the steady samples of the first tenth
    of the run and of the last (`ends_ratio`'s ends; samples without `cpu`: none). Not a
    verdict: what a rise of the steady iteration time is read against on a machine whose
    ranks share cores (the trainers get what the other classes leave)."""
    steady = [r for r in samples if not r["in_recovery"] and not r.get("degraded")]
    out = {}
    for cls in dict.fromkeys(c for r in steady for c in r["classes"]):
        values = [r["classes"][cls]["cpu"] for r in steady if "cpu" in r["classes"][cls]]
        ends = ends_ratio(values)
        if ends is not None:
            out[cls] = (round(ends[0], 3), round(ends[1], 3))
    return out


def _recovery_key(r: dict[str, Any]) -> tuple[str, str]:
    return (r.get("fault") or r["kind"], r["mode"])


def restart_s(r: dict[str, Any]) -> float:
    """A recovery's detection plus restart: from the fault to training again, before any
    recomputation (`total_s` for records without the breakdown)."""
    if r.get("init_s") is None:
        return r["total_s"]
    return (r.get("detect_s") or 0.0) + r["init_s"]


def recompute_s(r: dict[str, Any]) -> float:
    return r.get("recompute_s") or 0.0


def recovery_ratio(
    recoveries: Sequence[dict[str, Any]], seconds: Callable[[dict[str, Any]], float] = restart_s
) -> list[float]:
    """Each recovery's `seconds` (default `restart_s`) over the median of its (fault kind,
    recovery mode)'s — a page loss recovered in place and one beyond tolerance restarted from
    a checkpoint differ —, in order of detection. A kind whose median is 0 (no recomputation
    in any of them) is left out."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for r in recoveries:
        by_key.setdefault(_recovery_key(r), []).append(seconds(r))
    medians = {k: statistics.median(v) for k, v in by_key.items()}
    ordered = sorted(recoveries, key=lambda r: r.get("detected_t", 0.0))
    return [
        seconds(r) / medians[_recovery_key(r)] for r in ordered if medians[_recovery_key(r)] > 0
    ]


STORE_KEYS_BOUND = 0.5
"""Largest slope of the job store's key count per recovery ([Note: soak bounds])."""

HANDLE_TOLERANCE = 1.0


def with_recoveries(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's `coordinator_stats` events (the final one left out), each with the number of
    recoveries finished before it (`recoveries`)."""
    done = sorted(e["t"] for e in events if e["kind"] == "recovery_done")
    out = []
    for e in events:
        if e["kind"] == "coordinator_stats" and not e.get("final"):
            out.append({**e, "recoveries": sum(t < e["t"] for t in done)})
    return out


def stats_points(stats: Sequence[dict[str, Any]]) -> list[tuple[int, int, float | None]]:
    """(recoveries, store keys less the fired-fault markers, handling p50) per window: the
    markers are one per scheduled fault (the harness's, bounded by its schedule), so the soak,
    whose every recovery follows a fault, would otherwise count them as growth."""
    return [
        (s["recoveries"], s["store_keys"] - s.get("fault_markers", 0), s.get("handle_ms_p50"))
        for s in stats
        if s.get("store_keys") is not None
    ]


def coordinator_checks(stats: Sequence[dict[str, Any]]) -> list[Check]:
    """The store's keys per recovery and the coordinator's handling time over the run."""
    points = stats_points(stats)
    by_count: dict[int, list[float]] = {}
    for r, keys, _ in points:
        by_count.setdefault(r, []).append(keys)
    groups = [(r, statistics.median(v)) for r, v in sorted(by_count.items()) if r >= 1]
    slope = fit_slope(groups) if len(groups) >= MIN_GROUPS else None
    keys = Check(
        "job-store keys per recovery",
        None if slope is None else slope <= STORE_KEYS_BOUND,
        "-" if slope is None else round(slope, 3),
        STORE_KEYS_BOUND,
        f"{points[0][1]} -> {points[-1][1]} keys" if points else "no coordinator_stats",
    )
    handle = [h for _, _, h in points if h is not None]
    ends = ends_ratio(handle)
    if ends is None or ends[2] is None:
        timing = Check(
            "coordinator handling time", None, "-", f"<={1 + HANDLE_TOLERANCE:.2f}", "too few"
        )
    else:
        first, last, ratio = ends
        timing = Check(
            "coordinator handling time",
            ratio <= 1 + HANDLE_TOLERANCE,
            round(ratio, 3),
            f"<={1 + HANDLE_TOLERANCE:.2f}",
            f"per message p50 {first:.3f} -> {last:.3f} ms (of {len(handle)} windows)",
        )
    return [keys, timing, _loop_stall(stats)]


def _loop_stall(stats: Sequence[dict[str, Any]]) -> Check:
    """The coordinator loop's longest pass over the run's logs per window (`poll_ms_max`):
    the last tenth's median against the first tenth's. A pass that grows with the run's length
    starves the loop — the 60-minute soak's reached 10.8 s and the coordinator declared its own
    node lost (fixed: the monitor analyzes a window, docs/soak.md)."""
    polls = [
        float(s["poll_ms_max"])
        for s in stats
        if s.get("kind") == "coordinator_stats"
        and not s.get("final")
        and s.get("poll_ms_max") is not None
    ]
    name, bound = "coordinator loop stall (longest poll)", f"<={1 + HANDLE_TOLERANCE:.2f}"
    ends = ends_ratio(polls)
    if ends is None or ends[2] is None:
        return Check(name, None, "-", bound, "too few")
    first, last, ratio = ends
    return Check(
        name,
        ratio <= 1 + HANDLE_TOLERANCE,
        round(ratio, 3),
        bound,
        f"longest poll per window, median {first:.1f} -> {last:.1f} ms (of {len(polls)} windows)",
    )
