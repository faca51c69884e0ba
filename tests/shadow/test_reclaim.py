"""OOM-free pre-initialization (Leto §6) under a kernel-enforced memory budget: a memory spike
that does not fit next to the shadows is absorbed by reclaiming them (the step succeeds, the run
stays bit-exact), and the same spike under the same budget without the controller is an OOM
kill. The budget is derived from a first run's measured memory, never hard-coded."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl
from unbroken.shadow.memory import BudgetUnavailable, require_budget_support

from ..foundation.conftest import tiny_job

SPIKE_MB = 300

try:
    require_budget_support()
    NO_BUDGET = ""
except BudgetUnavailable as exc:  # an environment without cgroup-v1 memory control
    NO_BUDGET = str(exc)

needs_budget = pytest.mark.skipif(bool(NO_BUDGET), reason=f"memory budget unsupported: {NO_BUDGET}")


def _job(budget_mb: int, reclaim: bool, spike: bool):
    # Late enough that the shadows are ready (they start with the job) on a busy machine.
    inject = [f"memspike:rank=0,iter=30,mb={SPIKE_MB}"] if spike else []
    cfg = tiny_job(world_size=2, iterations=36, inject=inject, interval=0)
    return dataclasses.replace(
        cfg,
        recovery=dataclasses.replace(
            cfg.recovery, memory_budget_mb=budget_mb, memory_reclaim=reclaim
        ),
    )


def _events(out, kind: str) -> list[dict]:
    return [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == kind]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A run under a budget it never reaches: the job's own peak memory without shadows, and
    what its shadows hold at L3."""
    out = tmp_path_factory.mktemp("measure")
    s = run_job(_job(1 << 20, True, spike=False), out, quiet=True)
    assert s["state"] == "done"
    (report,) = _events(out, "memory_report")
    assert report["oom_kills"] == 0 and not _events(out, "shadows_reclaimed")
    assert "3" in report["footprint_mb"], f"the shadows never got ready in this run: {report}"
    shadows_mb = 2 * report["footprint_mb"]["3"]
    assert shadows_mb > 10, report  # the shadows hold real memory
    # With its shadows, the spike overshoots the budget by half their footprint; without
    # them it stays under it by as much.
    budget = round(report["peak_active_mb"] + SPIKE_MB + shadows_mb / 2)
    return {"hash": s["final_state_hash"], "budget_mb": budget}


@needs_budget
@pytest.mark.ci_required  # CI runs as root with the cgroup-v1 memory controller
def test_reclamation_absorbs_the_spike_and_training_stays_exact(measured, tmp_path):
    s = run_job(_job(measured["budget_mb"], True, spike=True), tmp_path, quiet=True)
    assert s["state"] == "done"
    assert s["final_state_hash"] == measured["hash"]
    assert not _events(tmp_path, "failure_detected")  # no process was lost
    (spike,) = _events(tmp_path, "memory_spike")
    (reclaim,) = _events(tmp_path, "shadows_reclaimed")
    assert reclaim["shadows"] == 2 and reclaim["level_from"] == 3
    assert reclaim["freed_mb"] > 0 and reclaim["level_to"] < 3, reclaim
    assert reclaim["t_oom"] < spike["t"]  # the spike's allocation waited for the reclamation
    (report,) = _events(tmp_path, "memory_report")
    assert report["oom_kills"] == 0


@needs_budget
@pytest.mark.ci_required  # CI runs as root with the cgroup-v1 memory controller
def test_without_reclamation_the_same_spike_is_an_oom_kill(measured, tmp_path):
    s = run_job(_job(measured["budget_mb"], False, spike=True), tmp_path, quiet=True)
    assert not _events(tmp_path, "shadows_reclaimed")
    killed = [e for e in _events(tmp_path, "failure_detected") if e.get("returncode") == -9]
    assert killed, "the OOM killer should have killed a trainer"
    # The OOM was a failure like any other: recovered in place, still exact.
    assert s["state"] == "done" and s["final_state_hash"] == measured["hash"]


@pytest.mark.slow  # 25 s: CI time; CI keeps the budget's reclamation and its OOM negative
def test_an_allocation_failure_is_retried_after_the_shadows_are_reclaimed(tmp_path):
    """The allocator's OOM (an injected `oom`: what CUDA's caching allocator raises when the
    device is full) makes the trainer ask its agent for the shadows' memory and compute the
    iteration again — no crash, no recovery, bit-exact."""
    faults = ["oom:rank=0,iter=30,phase=backward"]
    cfg = tiny_job(world_size=2, iterations=36, inject=faults, interval=0)
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done" and s["bit_exact"] is True
    assert not _events(tmp_path, "failure_detected")
    (retry,) = _events(tmp_path, "oom_retry")
    assert (retry["iter"], retry["phase"], retry["reclaimed"]) == (30, "backward", 2)
    (reclaim,) = _events(tmp_path, "shadows_reclaimed")
    assert "allocation failure in rank 0" in reclaim["cause"] and reclaim["level_from"] == 3


@pytest.mark.slow  # 24 s; CI keeps the retried allocation failure and the OOM kill without reclamation
def test_an_allocation_failure_with_nothing_to_reclaim_is_a_crash_recovered_in_place(tmp_path):
    faults = ["oom:rank=1,iter=5,phase=forward"]
    cfg = tiny_job(world_size=2, iterations=10, inject=faults, interval=0)
    cfg = dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, shadow_level=0))
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done" and s["bit_exact"] is True
    (detected,) = _events(tmp_path, "failure_detected")
    assert "OutOfMemoryError" in detected["reason"]
