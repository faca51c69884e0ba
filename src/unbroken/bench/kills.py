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

Finding trainers from outside, through /proc only: a trainer is a descendant process started
as `python -m unbroken.launch.trainer`, or a child of the shadow fork server (the standard
library's `multiprocessing.forkserver`, see `unbroken.shadow.forkserver`; its children are
trainers started as shadows); an *active* one runs at nice 0 — parked shadows run at the
agent's shadow niceness until they are promoted.
"""

from __future__ import annotations

import os
import random
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


def active_trainers(root: int | None = None) -> list[int]:
    """Pids of the active (non-shadow) trainer processes among `root`'s descendants (default:
    this process)."""
    root = os.getpid() if root is None else root
    found = []
    for pid, parent in _descendants(root).items():
        cmd = _cmdline(pid)
        # Not the fork server itself: its command line names the trainer module among its
        # preloads, and its parent is the agent.
        trainer = "-m unbroken.launch.trainer " in cmd or (
            _FORKSERVER in _cmdline(parent) and _FORKSERVER in cmd
        )
        st = _proc_stat(pid)
        if trainer and st is not None and st[1] == 0:
            found.append(pid)
    return sorted(found)


@dataclass(slots=True)
class KillRecord:
    trial: int
    delay_s: float
    """Drawn delay after the first completed iteration."""
    killed_pid: int | None = None
    t_kill: float | None = None
    state: str = ""
    final_hash: str | None = None
    exact: bool = False
    detected: bool = False
    recovery_s: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)


def _first_iteration_done(run_dir: Path, stop: threading.Event) -> bool:
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        if metrics.exists() and metrics.stat().st_size > 0:
            return True
        stop.wait(0.01)
    return False


def _killer(run_dir: Path, rec: KillRecord, rng: random.Random, stop: threading.Event) -> None:
    if not _first_iteration_done(run_dir, stop) or stop.wait(rec.delay_s):
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


def _trial(cfg: JobConfig, run_dir: Path, rec: KillRecord, rng: random.Random) -> None:
    """One job with the killer beside it; fills `rec` from the job's summary and logs."""
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a reused dir's old progress
    stop = threading.Event()
    killer = threading.Thread(target=_killer, args=(run_dir, rec, rng, stop), daemon=True)
    killer.start()
    try:
        s = run_job(cfg, run_dir, quiet=True)
    finally:
        stop.set()
        killer.join()
    rec.state = s["state"]
    rec.final_hash = s["final_state_hash"]
    kill_t = rec.t_kill if rec.t_kill is not None else float("inf")
    after = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("t", 0) >= kill_t]
    rec.detected = any(e.get("kind") == "failure_detected" for e in after)
    # Leto's initialization time I: the kill -> the first iteration started after it.
    starts = [m["t_start"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    resumed = [t for t in starts if t >= kill_t]
    rec.recovery_s = (min(resumed) - kill_t) if resumed else None
    rec.events = [
        {k: e.get(k) for k in ("kind", "reason", "mode", "rank")}
        for e in after
        if e.get("kind") in ("failure_detected", "recovery_start", "recovery_done")
    ]


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
)


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
        "records": [{k: getattr(r, k) for k in _RECORD_FIELDS} for r in records],
    }


def run_campaign(
    cfg: JobConfig, root: Path, *, trials: int, seed: int, say=lambda text: None
) -> dict[str, Any]:
    """Run the fault-free reference, then `trials` runs each killed once at a random time.

    Returns the campaign's figures: trials that were killed, how many ended bit-exact, and
    every trial's record (kill delay, pid, detection, and `recovery_s`: the kill to the start
    of the first iteration after it — Leto's initialization time).
    """
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    t0 = time.time()
    reference_hash = run_job(cfg, root / "reference", quiet=True)["final_state_hash"]
    # Kill times are drawn over the reference's training after its first iteration (start-up
    # excluded: the killer starts counting at the first completed iteration).
    rows = read_jsonl(root / "reference" / "metrics.jsonl")
    span = rows[-1]["t_end"] - rows[0]["t_end"] if len(rows) > 1 else 1.0
    rng = random.Random(seed)
    records: list[KillRecord] = []
    for trial in range(trials):
        rec = KillRecord(trial, rng.uniform(0.0, span))
        _trial(cfg, root / f"trial{trial:03d}", rec, random.Random(rng.random()))
        rec.exact = rec.final_hash == reference_hash
        records.append(rec)
        say(
            f"trial {trial + 1}/{trials}: kill after {rec.delay_s:.2f} s "
            f"(pid {rec.killed_pid}) -> {rec.state}, "
            f"{'exact' if rec.exact else 'DIVERGED'}"
            + (f", recovered in {rec.recovery_s:.2f} s" if rec.recovery_s else "")
        )
    figures = _figures(records)
    figures.update(reference_state_hash=reference_hash, seconds=time.time() - t0)
    return figures
