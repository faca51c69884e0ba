"""External random-time kill campaign: SIGKILL an active trainer at a uniformly random
wall-clock time, from outside the job, and require a bit-exact recovery.

The injector's faults fire at hook points, where the trainer happens to be between two
operations (on a GPU: after it has enqueued them, not after they ran). A real crash lands
anywhere: inside a kernel launch, between a launch and the marker write that describes it,
in the middle of a copy. Here a thread of the benchmark process, which the job knows nothing
about, waits until the job has completed its first iteration, sleeps a time drawn uniformly
over the rest of the run's expected length, finds the job's active trainers among its own
descendant processes and kills one. Every trial's final state must equal the fault-free
reference's bit for bit.

Uniform times rarely land inside the update, a few milliseconds of an iteration on a GPU. An
aimed campaign (`aim_s`) predicts the end of an iteration from the job's own metrics (the
update is an iteration's last phase) and kills uniformly within `aim_s` before it; the repair
then records the marker it found, so every trial says where it landed (`where_killed`:
inside a chunk transaction, before the first, or outside the update).

Finding trainers from outside, through /proc only: a trainer is a descendant process started
as `python -m unbroken.launch.trainer`, or a child of the shadow fork server (the standard
library's `multiprocessing.forkserver`, see `unbroken.shadow.forkserver`; its children are
trainers started as shadows); an *active* one runs at nice 0 — parked shadows run at the
agent's shadow niceness until they are promoted.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig

__all__ = ["KillRecord", "active_trainers", "run_campaign"]


_FORKSERVER = "multiprocessing.forkserver"


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, nice) of a live process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[16])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of every live descendant of `root`."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                parents[int(entry)] = st[0]
    out: dict[int, int] = {}
    frontier = {root}
    while frontier:
        nxt = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out.update({p: parents[p] for p in nxt})
        frontier = nxt
    return out


def _job_nice() -> int:
    """This process's niceness, which the job it starts inherits.

    Raises:
        UserError: shadows would run at the job's niceness (it is too nice to be exceeded by
            `SHADOW_NICE`, or the agent could not restore a promoted shadow's priority), so
            trainers and shadows would look alike.
    """
    from unbroken.errors import UserError
    from unbroken.launch.agent.supervisor import SHADOW_NICE, shadow_nice

    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice + SHADOW_NICE > 19 or shadow_nice(nice) == 0:
        raise UserError(
            f"the kill campaign at niceness {nice}: shadows would run at the job's niceness and "
            f"look like trainers; run it at niceness {19 - SHADOW_NICE} or less, as a user "
            "allowed to restore a niceness (root or RLIMIT_NICE)"
        )
    return nice


def active_trainers(root: int | None = None) -> list[int]:
    """Pids of the active (non-shadow) trainer processes among `root`'s descendants (default:
    this process): trainer processes at the job's niceness (this process's), where shadows run
    `SHADOW_NICE` above it.

    Raises:
        UserError: this process is so nice that shadows cannot be niced above it.
    """
    root = os.getpid() if root is None else root
    job_nice = _job_nice()
    found = []
    for pid, parent in _descendants(root).items():
        cmd = _cmdline(pid)
        # Not the fork server itself: its command line names the trainer module among its
        # preloads, and its parent is the agent.
        trainer = "-m unbroken.launch.trainer " in cmd or (
            _FORKSERVER in _cmdline(parent) and _FORKSERVER in cmd
        )
        st = _proc_stat(pid)
        if trainer and st is not None and st[1] == job_nice:
            found.append(pid)
    return sorted(found)


@dataclass(slots=True)
class KillRecord:
    trial: int
    delay_s: float
    """Drawn delay after the first completed iteration (after the previous kill's recovery);
    in an aimed campaign, seconds before the predicted end of an iteration."""
    killed_pid: int | None = None
    t_kill: float | None = None
    state: str = ""
    final_hash: str | None = None
    exact: bool = False
    detected: bool = False
    recovery_s: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    phase: str | None = None
    """Where the killed rank was, as the recovery recorded it (its last heartbeat's phase)."""
    fixup: str | None = None
    """What the in-place repair did to the interrupted update (`inplace_repair`'s fixup:
    "none" when the kill landed outside a chunk transaction)."""
    marker: dict[str, Any] = field(default_factory=dict)
    """The progress marker the repair found (`inplace_repair`'s marker: stage, iteration,
    group, chunk)."""
    breakdown: dict[str, Any] = field(default_factory=dict)
    """The recovery's own times (detect_s, init_s, recompute_s, total_s) from the summary."""

    @property
    def where(self) -> str:
        """Where the kill left the update (`where_killed`)."""
        return where_killed(self.marker)


def _first_iteration_done(run_dir: Path, stop: threading.Event) -> bool:
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        if metrics.exists() and metrics.stat().st_size > 0:
            return True
        stop.wait(0.01)
    return False


def _resumed_after(run_dir: Path, t: float, stop: threading.Event) -> bool:
    """Wait until an iteration has started after time `t` (the job recovered from a kill)."""
    from unbroken.metrics.log import read_jsonl

    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        if metrics.exists() and any(m["t_start"] >= t for m in read_jsonl(metrics)):
            return True
        stop.wait(0.05)
    return False


def _aim(run_dir: Path, since: float, before_end_s: float, stop: threading.Event) -> float | None:
    """The wall time `before_end_s` before the predicted end of an iteration: the period of
    the last three iterations started after `since`, extrapolated two iterations past the
    newest (the update is an iteration's last phase: its end is the update's)."""
    from unbroken.metrics.log import read_jsonl

    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        rows = [m for m in read_jsonl(metrics) if m["t_start"] >= since] if metrics.exists() else []
        if len(rows) >= 3:
            ends = sorted(m["t_end"] for m in rows)[-3:]
            return ends[-1] + (ends[-1] - ends[0]) - before_end_s  # two periods on
        stop.wait(0.01)
    return None


def _killer(
    run_dir: Path,
    recs: list[KillRecord],
    rng: random.Random,
    stop: threading.Event,
    aimed: bool = False,
) -> None:
    """Kill once per record: the first after its delay from the first completed iteration,
    each later one after its delay from the previous kill's recovery (an iteration started
    after it), so every kill lands in training, not in a recovery. `aimed`: each kill lands
    its delay before the predicted end of an iteration instead (`_aim`)."""
    if not _first_iteration_done(run_dir, stop):
        return
    since = 0.0
    for rec in recs:
        if aimed:
            at = _aim(run_dir, since, rec.delay_s, stop)
            if at is None or stop.wait(max(0.0, at - time.time())):
                return
        elif stop.wait(rec.delay_s):
            return
        pids = active_trainers()
        if not pids:
            return
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        rec.killed_pid, rec.t_kill = pid, time.time()
        since = rec.t_kill
        if not _resumed_after(run_dir, rec.t_kill, stop):
            return


def _trial(
    cfg: JobConfig, run_dir: Path, recs: list[KillRecord], rng: random.Random, aimed: bool
) -> None:
    """One job with the killer beside it; fills `recs` from the job's summary and logs."""
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a reused dir's old progress
    stop = threading.Event()
    killer = threading.Thread(target=_killer, args=(run_dir, recs, rng, stop, aimed), daemon=True)
    killer.start()
    try:
        s = run_job(cfg, run_dir, quiet=True)
    finally:
        stop.set()
        killer.join()
    events = read_jsonl(run_dir / "events.jsonl")
    starts = [m["t_start"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    kills = sorted(r.t_kill for r in recs if r.t_kill is not None)
    for rec in recs:
        rec.state = s["state"]
        rec.final_hash = s["final_state_hash"]
        kill_t = rec.t_kill if rec.t_kill is not None else float("inf")
        until = min((t for t in kills if t > kill_t), default=float("inf"))
        after = [e for e in events if kill_t <= e.get("t", 0) < until]
        rec.detected = any(e.get("kind") == "failure_detected" for e in after)
        # Leto's initialization time I: the kill -> the first iteration started after it.
        resumed = [t for t in starts if t >= kill_t]
        rec.recovery_s = (min(resumed) - kill_t) if resumed else None
        rec.events = [
            {k: e.get(k) for k in ("kind", "reason", "mode", "rank")}
            for e in after
            if e.get("kind") in ("failure_detected", "recovery_start", "recovery_done")
        ]
        failed = [e.get("rank") for e in after if e.get("kind") == "failure_detected"]
        repairs = [  # the killed rank's repair (each rank repairs its own state)
            e
            for e in after
            if e.get("kind") == "inplace_repair" and (not failed or e.get("rank") == failed[0])
        ]
        rec.fixup = repairs[0].get("fixup") if repairs else None
        rec.marker = (repairs[0].get("marker") or {}) if repairs else {}
        mine = [r for r in s.get("recoveries", []) if kill_t <= r.get("detected_t", 0) < until]
        if mine:
            r = mine[0]
            rec.phase = r.get("phase")
            rec.breakdown = {
                k: r.get(k) for k in ("detect_s", "init_s", "recompute_s", "total_s", "mode")
            }


_RECORD_FIELDS = (
    "trial",
    "delay_s",
    "killed_pid",
    "t_kill",
    "state",
    "exact",
    "detected",
    "recovery_s",
    "events",
    "phase",
    "fixup",
    "marker",
    "where",
    "breakdown",
)


def where_killed(marker: dict[str, Any]) -> str:
    """Where a kill left the update, by the marker the repair found: "transaction" (inside
    the chunk transactions: a chunk updating, its parity ready, or committed with more to
    go), "before_update" (gradients protected or the sync recorded, no chunk started),
    "outside" (the update complete: forward, backward or the boundary), or "unknown" (no
    in-place repair recorded)."""
    stage = marker.get("stage")
    if stage is None:
        return "unknown"
    if stage in ("CHUNK_UPDATING", "PARITY_READY"):
        return "transaction"
    if stage == "SYNCED":
        first = marker.get("group", 0) == 0 and marker.get("chunk", 0) == 0
        return "before_update" if first else "transaction"
    if stage == "GRADS_PROTECTED":
        return "before_update"
    return "outside"


def _figures(records: list[KillRecord]) -> dict[str, Any]:
    killed = [r for r in records if r.killed_pid is not None]
    recov = [r.recovery_s for r in killed if r.recovery_s is not None]
    return {
        "trials": len(killed),
        "exact": sum(r.exact for r in killed),
        "drawn": len(records),
        "not_killed": len(records) - len(killed),
        "all_exact": all(r.exact for r in records),
        "undetected": sum(not r.detected for r in killed),
        "median_recovery_s": statistics.median(recov) if recov else None,
        "where": {
            w: {"trials": len(rs), "exact": sum(r.exact for r in rs)}
            for w in ("transaction", "before_update", "outside", "unknown")
            if (rs := [r for r in killed if r.where == w])
        },
        "records": [{k: getattr(r, k) for k in _RECORD_FIELDS} for r in records],
    }


def _line(rec: KillRecord, trials: int, run: int, aimed: bool) -> str:
    """One trial's progress line."""
    when = f"{rec.delay_s * 1e3:.1f} ms before an end" if aimed else f"after {rec.delay_s:.2f} s"
    return (
        f"trial {rec.trial + 1}/{trials} (run {run + 1}): kill {when} "
        f"(pid {rec.killed_pid}, {rec.where}) -> {rec.state}, "
        f"{'exact' if rec.exact else 'DIVERGED'}"
        + (f", recovered in {rec.recovery_s:.2f} s" if rec.recovery_s else "")
    )


def _drop_checkpoints(run_dir: Path) -> None:
    """A finished run's checkpoints: the campaign reads only its events and metrics (a 125m
    run keeps three saves of 1.5 GB each; thirty trials would fill a device machine's disk)."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def run_campaign(
    cfg: JobConfig,
    root: Path,
    *,
    trials: int,
    seed: int,
    kills_per_run: int = 1,
    aim_s: float | None = None,
    say=lambda text: None,
) -> dict[str, Any]:
    """Run the fault-free reference, then `trials` kills at random times, `kills_per_run` in
    each run (the default, one, makes every trial its own run). `aim_s`: aim every kill at
    the update instead — uniformly within `aim_s` seconds before the predicted end of an
    iteration (`_aim`); the records say where each landed (`where_killed`).

    A run with several kills recovers from each before the next (see `_killer`), and its final
    state must still equal the reference's: each of its kills counts as exact only when the
    whole run is. Returns the campaign's figures: trials that were killed, how many ended
    bit-exact, and every trial's record (kill delay, pid, detection, and `recovery_s`: the kill
    to the start of the first iteration after it — Leto's initialization time).
    """
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    _job_nice()  # refuse before the reference runs, not silently in the killer thread
    t0 = time.time()
    reference_hash = run_job(cfg, root / "reference", quiet=True)["final_state_hash"]
    _drop_checkpoints(root / "reference")
    # Kill times are drawn over the reference's training after its first iteration (start-up
    # excluded: the killer starts counting at the first completed iteration), split evenly
    # between a run's kills.
    rows = read_jsonl(root / "reference" / "metrics.jsonl")
    span = rows[-1]["t_end"] - rows[0]["t_end"] if len(rows) > 1 else 1.0
    per = max(1, kills_per_run)
    rng = random.Random(seed)
    records: list[KillRecord] = []
    aimed = aim_s is not None
    upper = aim_s if aimed else span / per
    for run in range(-(-trials // per)):
        recs = [
            KillRecord(len(records) + j, rng.uniform(0.0, upper))
            for j in range(min(per, trials - len(records)))
        ]
        _trial(cfg, root / f"trial{run:03d}", recs, random.Random(rng.random()), aimed)
        _drop_checkpoints(root / f"trial{run:03d}")
        for rec in recs:
            rec.exact = rec.final_hash == reference_hash
            say(_line(rec, trials, run, aimed))
        records.extend(recs)
    figures = _figures(records)
    figures.update(
        reference_state_hash=reference_hash,
        kills_per_run=per,
        aim_s=aim_s,
        seconds=time.time() - t0,
    )
    return figures
