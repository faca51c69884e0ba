"""A parked shadow maps its device's retained state before the failure (`MapRetained`, once its
trainer has completed an iteration); promoted, it finds every region mapped, attaches without
mapping any, and the job resumes exactly."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job
from .test_shadows import _pids, _reference_then_background_run, _wait_for


def test_a_promoted_shadow_finds_the_retained_state_premapped_and_resumes_exactly(tmp_path):
    """Ordered by what the job reports, not by time: once generation 0 has trained and both
    shadows are parked, the trainers are stopped (the job cannot end meanwhile); the agent's
    next beat sends `MapRetained`, which a parked shadow handles before any `Promote`; once both
    shadows report `retained_premapped`, a trainer is killed (the other resumes; the agent may
    also find the stopped pair hung first: the same takeover)."""
    ref, out, result, job = _reference_then_background_run(tmp_path, iterations=30)

    def events(kind: str, generation: int | None = 1) -> list[dict]:
        """`kind` events of `generation` (None: of any)."""
        if not (out / "events.jsonl").exists():
            return []
        found = read_jsonl(out / "events.jsonl")
        return [e for e in found if e["kind"] == kind and generation in (None, e.get("generation"))]

    def trained() -> bool:
        return (out / "metrics.jsonl").exists() and any(
            r["generation"] == 0 for r in read_jsonl(out / "metrics.jsonl")
        )

    _wait_for(lambda: trained() and len(events("shadow_ready")) == 2)
    trainers = _pids("--spec " + str(out / "specs" / "train-gen0.json"))
    assert trainers, "the job finished before the test could act"
    for pid in trainers:
        os.kill(pid, signal.SIGSTOP)
    try:
        premapped = _wait_for(lambda: (p := events("retained_premapped")) and len(p) == 2 and p)
        with contextlib.suppress(ProcessLookupError):  # (the agent may have found it hung)
            os.kill(trainers[0], signal.SIGKILL)
    finally:
        for pid in trainers[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    job.join(timeout=600)
    assert result["state"] == "done"
    assert result["final_state_hash"] == ref["final_state_hash"]
    regions = {e["regions"] for e in premapped}
    assert len(regions) == 1 and regions.pop() > 0
    (ready,) = events("trainer_ready")
    assert ready["recovery"] == "inplace"
    # Rank 0 reports it: every region it attached was the one its shadow had mapped.
    assert ready["premapped"] == premapped[0]["regions"]
    assert {e["rank"] for e in events("shadow_promoted")} == {0, 1}
    assert not events("retained_premap_failed") and not events("checkpoint_loaded", None)


@pytest.mark.slow  # 17 s; the negative control of the premapping above
def test_without_premapping_the_promoted_shadow_maps_the_regions_itself(tmp_path):
    """The negative control: `recovery.premap = false` leaves the shadows unmapped; the same
    takeover maps every region in the promoted trainer (and is exact too)."""
    cfg = tiny_job(iterations=14, inject=["kill:rank=1,iter=9,phase=update"], interval=0)
    cfg.recovery.premap = False
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["bit_exact"] is True and s["failures_recovered"] == 1
    events = read_jsonl(tmp_path / "events.jsonl")
    assert not [e for e in events if e["kind"] == "retained_premapped"]
    ready = [e for e in events if e["kind"] == "trainer_ready" and e["generation"] == 1]
    assert ready and ready[0]["premapped"] == 0
