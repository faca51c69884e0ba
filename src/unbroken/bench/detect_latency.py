"""Fail-stop detection latency, measured on real runs (`unbroken bench detect --latency`).

Four failure kinds, each measured `repeats` times against the bound the configuration implies:

- process exit (SIGKILL of a trainer, the `kill` fault) and hang (SIGSTOP, the `hang` fault):
  one training job with alternating faults; each is recovered in place and the next one fires
  later. Latency = the coordinator's `failure_detected` record time minus the injector's
  `failure_injected` time (written right before the signal). Bounds: exit — one agent tick
  (`TICK_S`) plus the coordinator's loop period; hang — the trainer heartbeat timeout plus
  one tick and one loop period (the last beat came up to one interval before the stop, so the
  latency lies in [timeout - interval, bound]).
- node loss: the agent is sent SIGKILL (its connection drops) or SIGSTOP (its beats stop),
  one run each. Latency = the coordinator's `node_lost` record time minus the time the signal
  was sent. Bounds: SIGKILL — `node_timeout_s` (the drop is seen at once; silence would catch
  it at the latest then); SIGSTOP — `node_timeout_s` plus one loop period.

All times are wall-clock on this machine (one clock, all processes local). A stopped agent is
killed once its loss is on record, so the run ends without waiting for its shutdown timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LatencyResult", "measure_latencies"]

_COORDINATOR_LOOP_S = 0.05
"""The coordinator's select timeout (`Coordinator.run`): its loop period when idle."""


@dataclass(slots=True)
class LatencyResult:
    kind: str
    bound_s: float
    bound_note: str
    samples_s: list[float] = field(default_factory=list)
    premature: int = 0
    """Node-loss runs discarded because the node was declared lost before the signal."""

    def to_dict(self) -> dict[str, Any]:
        s = self.samples_s
        return {
            "kind": self.kind,
            "n": len(s),
            "median_s": statistics.median(s) if s else None,
            "max_s": max(s) if s else None,
            "min_s": min(s) if s else None,
            "bound_s": self.bound_s,
            "bound": self.bound_note,
            "within_bound": bool(s) and max(s) <= self.bound_s,
            "samples_s": s,
            "premature": self.premature,
        }


def _config(iterations: int, faults: list[str]):
    from unbroken.config import (
        CheckpointConfig,
        DataConfig,
        JobConfig,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )

    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=200),
        train=TrainConfig(iterations=iterations, lr=1e-3),
        parallel=ParallelConfig(world_size=2),
        checkpoint=CheckpointConfig(interval=0),
        inject=faults,
    )


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rank_faults(repeats: int, out: Path) -> tuple[LatencyResult, LatencyResult]:
    from unbroken.api import run_job
    from unbroken.launch.agent import TICK_S
    from unbroken.metrics.log import read_jsonl

    gap = 4  # iterations between faults: each is recovered before the next fires
    faults = []
    for i in range(2 * repeats):
        kind = "kill" if i % 2 == 0 else "hang"
        faults.append(f"{kind}:rank={i % 2},iter={3 + gap * i},phase=backward")
    cfg = _config(3 + gap * 2 * repeats + 2, faults)
    rec = cfg.recovery
    exit_ = LatencyResult(
        "process exit (trainer SIGKILL)",
        TICK_S + _COORDINATOR_LOOP_S,
        f"agent woken by the trainer's pidfd (at worst one tick, {TICK_S * 1000:.0f} ms) + "
        f"coordinator loop {_COORDINATOR_LOOP_S * 1000:.0f} ms",
    )
    hang = LatencyResult(
        "hang (trainer SIGSTOP)",
        rec.heartbeat_timeout_s + TICK_S + _COORDINATOR_LOOP_S,
        f"heartbeat_timeout_s {rec.heartbeat_timeout_s:g} s (interval "
        f"{rec.heartbeat_interval_s:g} s) + tick + loop",
    )
    _say(f"latency: one job, {len(faults)} rank faults ({repeats} kill, {repeats} hang)...")
    summary = run_job(cfg, out / "ranks", quiet=True)
    if summary.state != "done":
        raise RuntimeError(f"rank-fault job ended {summary.state}: {summary.reason}")
    events = read_jsonl(out / "ranks" / "events.jsonl")
    injected = [e for e in events if e["kind"] == "failure_injected"]
    detected = [e for e in events if e["kind"] == "failure_detected"]
    for inj in injected:
        first = next((d for d in detected if d["t"] >= inj["t"]), None)
        if first is None or first["rank"] != inj["rank"]:
            raise RuntimeError(f"no detection of {inj['spec']}")
        (exit_ if inj["fault"] == "kill" else hang).samples_s.append(first["t"] - inj["t"])
    return exit_, hang


def _agent_pid(run_dir: Path) -> int | None:
    """The pid of the agent serving this run's coordinator (by its command line)."""
    port = json.loads((run_dir / "coordinator-train.json").read_text())["port"]
    want = f"127.0.0.1:{port}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
        except OSError:
            continue
        if b"unbroken.launch.agent" in cmd and want in cmd:
            return int(entry)
    return None


def _poll(predicate, timeout_s: float, what: str):
    """Poll a condition of files on disk (the run is another thread's; nothing to wait on)."""
    t_end = time.time() + timeout_s
    while time.time() < t_end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


class _Premature(RuntimeError):
    """The node was declared lost before the signal (an overloaded machine starved the agent)."""


def _node_loss(sig: signal.Signals, run_dir: Path) -> float:
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    cfg = _config(100_000, [])
    result: dict[str, Any] = {}
    job = threading.Thread(target=lambda: result.update(run_job(cfg, run_dir, quiet=True)))
    job.start()
    pid = None
    try:
        _poll(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and (run_dir / "metrics.jsonl").stat().st_size > 0
            ),
            300,
            "the first iteration",
        )
        pid = _poll(lambda: _agent_pid(run_dir), 30, "the agent's pid")
        if any(e["kind"] == "node_lost" for e in read_jsonl(run_dir / "events.jsonl")):
            raise _Premature(str(run_dir))
        t_loss = time.time()
        os.kill(pid, sig)
        lost = _poll(
            lambda: [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "node_lost"],
            120,
            "node_lost",
        )
    finally:
        if pid is not None and sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # its loss is on record; let the run end now
        job.join(timeout=180)
    if result.get("state") != "failed":
        raise RuntimeError(f"run after agent {sig.name} ended {result.get('state')}")
    return lost[0]["t"] - t_loss


def measure_latencies(repeats: int, out: Path | None = None) -> list[LatencyResult]:
    """Measure every kind `repeats` times; run dirs under `out` (default: a temp dir)."""
    from unbroken.config import RecoveryConfig

    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="unbroken-latency-"))
    out.mkdir(parents=True, exist_ok=True)
    results = list(_rank_faults(repeats, out))
    rec = RecoveryConfig()
    kill = LatencyResult(
        "node loss (agent SIGKILL)",
        rec.node_timeout_s,
        f"node_timeout_s {rec.node_timeout_s:g} s (connection drop: at once)",
    )
    stop = LatencyResult(
        "node loss (agent SIGSTOP)",
        rec.node_timeout_s + _COORDINATOR_LOOP_S,
        f"node_timeout_s {rec.node_timeout_s:g} s (beats every {rec.node_heartbeat_s:g} s) + loop",
    )
    for res, sig in ((kill, signal.SIGKILL), (stop, signal.SIGSTOP)):
        for i in range(repeats):
            _say(f"latency: {res.kind} {i + 1}/{repeats}...")
            for attempt in range(3):
                try:
                    res.samples_s.append(_node_loss(sig, out / f"{sig.name.lower()}-{i}-{attempt}"))
                    break
                except _Premature:
                    res.premature += 1  # reported; the sample is measured again
    results += [kill, stop]
    return results
