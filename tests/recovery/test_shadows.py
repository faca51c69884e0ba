"""Shadow trainers: a crash is taken over by pre-initialized shadows (no checkpoint, exact);
a shadow lost before the takeover is survived by starting fresh processes, still exact."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job


def _wait_for(predicate, timeout=180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)  # polling files another process writes; not used to order events
    raise TimeoutError("condition not reached")


def _proc_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped, Z ...); "X" once reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def _dead(pid: int) -> bool:
    return _proc_state(pid) in ("Z", "X")


def _pids(pattern: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pattern in cmd:
                out.append(int(entry))
    return out


@pytest.mark.slow  # 19 s: CI time; CI keeps the L3 takeover in tests/recovery/test_premap.py
def test_l3_shadows_take_over_a_crash_exactly(tmp_path):
    faults = ["kill:rank=1,iter=9,phase=update"]
    cfg = tiny_job(iterations=14, inject=faults, interval=0)
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["bit_exact"] is True and s["failures_recovered"] == 1
    (r,) = s["recoveries"]
    assert r["mode"] == "inplace" and r["shadow_level"] == 3
    events = read_jsonl(tmp_path / "events.jsonl")
    promoted = [e for e in events if e["kind"] == "shadow_promoted"]
    assert {e["rank"] for e in promoted} == {0, 1}
    assert not [e for e in events if e["kind"] == "checkpoint_loaded"]


def _reference_then_background_run(tmp_path, iterations: int = 150):
    """A job of `iterations`: its fault-free reference without shadows (run to the end), then
    the job itself with shadows, started in a thread for the test to act on.
    Returns (reference summary, run dir, the run's summary once joined, its thread)."""
    cfg = tiny_job(iterations=iterations, interval=0)
    ref = run_job(
        dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, shadow_level=0)),
        tmp_path / "ref",
        quiet=True,
    )
    out = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(run_job(cfg, out, quiet=True)))
    job.start()
    return ref, out, result, job


@pytest.mark.slow  # ~35 s; CI covers a shadow that dies (in its takeover) and the fresh
# processes that replace it in test_a_shadow_killed_mid_takeover_is_survived_exactly
def test_a_lost_shadow_is_survived_by_fresh_processes(tmp_path):
    ref, out, result, job = _reference_then_background_run(tmp_path)

    def shadows() -> list[int]:
        if not (out / "metrics.jsonl").exists():
            return []
        ready = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "shadow_ready"]
        return [e["pid"] for e in ready if e["generation"] == 1]

    # Training under way, and both shadows for generation 1 ready.
    _wait_for(lambda: len(shadows()) == 2)
    shadow = shadows()
    trainers = _pids("--spec " + str(out / "specs" / "train-gen0.json"))
    assert shadow and trainers, "the job finished before the test could act"
    os.kill(shadow[0], signal.SIGKILL)  # a shadow dies ...
    _wait_for(lambda: _dead(shadow[0]))  # (the kernel has made it a zombie or reaped it)
    os.kill(trainers[0], signal.SIGKILL)  # ... then an active trainer crashes
    job.join(timeout=600)
    assert result["state"] == "done"
    events = read_jsonl(out / "events.jsonl")
    assert [e for e in events if e["kind"] == "failure_detected"]
    assert not [e for e in events if e["kind"] == "shadows_promoted" and e["generation"] == 1]
    assert result["final_state_hash"] == ref["final_state_hash"]


@pytest.mark.slow  # ~36 s on 2 cores; CI keeps the L3 takeover and the dead-shadow fallback
def test_a_shadow_killed_mid_takeover_is_survived_exactly(tmp_path):
    """The promoted shadow dies while it attaches, repairs and resumes: that is a failure of the
    new generation, recovered like any other — in place — and the result is still exact.

    The kill is made to land inside the takeover, not after it: rank 1's shadow is held
    (SIGSTOP) from before the crash, so rank 0's promoted shadow cannot get past the ranks'
    agreement on where the job stands (a collective) to `trainer_ready`; it is killed there."""
    ref, out, result, job = _reference_then_background_run(tmp_path)

    def events(kind: str) -> list[dict]:
        if not (out / "events.jsonl").exists():
            return []
        return [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == kind]

    def trained() -> bool:  # generation 0 has retained progress (the shadows can be ready before)
        return any(r["generation"] == 0 for r in read_jsonl(out / "metrics.jsonl"))

    def shadows() -> dict[int, int]:
        return {e["rank"]: e["pid"] for e in events("shadow_ready") if e["generation"] == 1}

    _wait_for(lambda: trained() and len(shadows()) == 2)
    shadow = shadows()
    trainers = _pids("--spec " + str(out / "specs" / "train-gen0.json"))
    assert trainers, "the job finished before the test could act"
    os.kill(shadow[1], signal.SIGSTOP)  # rank 1's shadow will be promoted, but cannot move
    try:
        os.kill(trainers[0], signal.SIGKILL)  # a trainer crashes; the shadows take over ...
        promoted = _wait_for(
            lambda: [
                e for e in events("shadow_promoted") if e["generation"] == 1 and e["rank"] == 0
            ]
        )
        assert _proc_state(shadow[1]) == "T", "rank 1's shadow is not held"
        assert not [e for e in events("trainer_ready") if e["generation"] == 1]
        t_kill = time.time()
        with contextlib.suppress(ProcessLookupError):  # (the agent may have stopped it first)
            os.kill(shadow[0], signal.SIGKILL)  # ... and one of them dies in the middle of it
    finally:
        os.kill(shadow[1], signal.SIGCONT)
    job.join(timeout=600)
    assert result["state"] == "done"
    # The kill landed inside the takeover: after rank 0's shadow was promoted, before its
    # generation was ready to train (rank 0 reports trainer_ready once restore is done).
    assert promoted[0]["t_promoted"] < t_kill
    assert not [e for e in events("trainer_ready") if e["generation"] == 1]
    held = [e for e in events("shadow_promoted") if e["generation"] == 1 and e["rank"] == 1]
    assert all(e["t_promoted"] > t_kill for e in held)  # rank 1 took no part before the kill
    detected = events("failure_detected")
    assert len(detected) >= 2 and any(e["generation"] == 1 for e in detected)
    assert not events("inplace_fallback") and not events("checkpoint_loaded")
    assert result["final_state_hash"] == ref["final_state_hash"]
