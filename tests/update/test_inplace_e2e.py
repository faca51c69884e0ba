"""In-place recovery end to end: real processes, state managers holding memfd regions, crashes
at every operation of the update phase and real page loss (holes punched in the memfds) —
recovered without a checkpoint, bit-identical to the fault-free reference. Loss beyond parity
tolerance is filled from a data-parallel replica, or without one falls back to
checkpoint-restart, still exact."""

from __future__ import annotations

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job

# Every operation of an iteration with RMU, one crash each (ranks alternate).
PHASES = ["forward", "protect", "sync", "update", "parity", "writeback", "marker", "boundary"]


def _events(out, kind):
    return [
        e for e in read_jsonl(out / "events.jsonl") if e["kind"] == kind and e["run"] == "faulty"
    ]


def test_crash_at_every_update_operation_recovers_in_place_bit_exact(tmp_path):
    faults = [f"kill:rank={i % 2},iter={1 + i},phase={p}" for i, p in enumerate(PHASES)]
    faults.append("pageloss:rank=1,iter=10,phase=update,pages=2,parity=1")
    s = run_job(
        tiny_job(iterations=12, inject=faults, interval=0), tmp_path, reference=True, quiet=True
    )
    assert s["failures_injected"] == len(faults)
    assert s["failures_recovered"] == len(faults)
    assert all(r["mode"] == "inplace" for r in s["recoveries"])
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    assert _events(tmp_path, "checkpoint_loaded") == []
    assert _events(tmp_path, "shadow_promoted")  # takeovers went through shadow trainers
    repairs = _events(tmp_path, "inplace_repair")
    lost = [r for r in repairs if r["lost_pages"]]
    assert len(lost) == 1
    assert (
        len(lost[0]["lost_pages"]["model"]) == 2 and len(lost[0]["lost_pages"]["model_parity"]) == 1
    )
    assert all(r["register_ms"] == 0 for r in repairs)  # host parity is registered on GPUs only
    fixups = {r["fixup"].split(" chunk")[0] for r in repairs}
    assert {"restored", "rolled"} <= fixups  # both undo restore and parity roll-forward ran
    # A crash inside the update phase loses no completed work: nothing is recomputed.
    for r in s["recoveries"]:
        if r["phase"] in ("update", "parity", "writeback"):
            assert r["recompute_s"] == 0.0 and r["restored_iter"] == r["iteration"] + 1


def test_loss_beyond_tolerance_on_one_replica_is_filled_from_another_exactly(tmp_path):
    """Two data-parallel replicas: rank 0 loses more pages of one group than parity covers.
    Its peer repairs, and rank 0 takes its state at the boundary — no checkpoint is loaded."""
    faults = ["pageloss:rank=0,iter=5,phase=update,pages=5"]  # 5 > H1 = 3 in one group
    s = run_job(
        tiny_job(iterations=8, inject=faults, interval=2), tmp_path, reference=True, quiet=True
    )
    assert s["failures_recovered"] == 1
    assert s["recoveries"][0]["mode"] == "inplace"
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    assert _events(tmp_path, "inplace_unrecoverable")
    assert _events(tmp_path, "checkpoint_loaded") == []
    fills = [
        r for r in _events(tmp_path, "inplace_repair") if r["fixup"] == "filled from a replica"
    ]
    assert [r["rank"] for r in fills] == [0] and "take a replica's state" in fills[0]["action"]


def test_loss_beyond_tolerance_without_a_replica_falls_back_to_checkpoint_exactly(tmp_path):
    faults = ["pageloss:rank=0,iter=5,phase=update,pages=5"]
    s = run_job(
        tiny_job(world_size=1, iterations=8, inject=faults, interval=2),
        tmp_path,
        reference=True,
        quiet=True,
    )
    assert s["failures_recovered"] == 1
    assert s["recoveries"][0]["mode"] == "ckpt_restart"
    assert s["bit_exact"] is True
    assert _events(tmp_path, "inplace_unrecoverable")
    assert _events(tmp_path, "checkpoint_loaded")
