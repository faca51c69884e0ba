"""The bit-exact audit sees every rank: unit tests of `audit` with negative controls, and an
end-to-end negative control — one flipped byte in a non-zero rank's replica after a recovery,
at the last iteration, where no later all-reduce could spread it to rank 0."""

from __future__ import annotations

import copy

from unbroken.api import run_job
from unbroken.launch.audit import replica_mismatches
from unbroken.metrics.summary import audit

from ..foundation.conftest import tiny_job


def _run(final="f", ranks=("a", "b"), rows=None):
    if rows is None:
        rows = ((0, "h0", ("a0", "b0")), (1, "f", ranks))
    return {
        "final_state_hash": final,
        "rank_hashes": list(ranks),
        "metrics": [
            {"iter": it, "state_hash": h, "rank_hashes": list(r) if r else None}
            for it, h, r in rows
        ],
    }


def test_identical_runs_are_bit_exact():
    a = audit(_run(), _run())
    assert a == {
        "bit_exact": True,
        "rank_mismatches": [],
        "per_iteration_mismatches": [],
        "per_rank_mismatches": [],
    }


def test_a_different_job_hash_is_not_bit_exact():
    assert audit(_run(), _run(final="g"))["bit_exact"] is False
    assert audit(_run(), _run(final=None))["bit_exact"] is False


def test_a_non_zero_rank_that_differs_alone_is_found_by_rank():
    bad = _run(ranks=("a", "x"), rows=((0, "h0", ("a0", "b0")), (1, "f", ("a", "x"))))
    a = audit(_run(), bad)
    assert a["bit_exact"] is False  # though the job hash (rank 0's) is the reference's
    assert a["rank_mismatches"] == [1]
    assert a["per_rank_mismatches"] == [{"iter": 1, "ranks": [1]}]


def test_an_intermediate_iteration_that_differs_is_not_bit_exact():
    bad = _run(rows=((0, "zz", ("a0", "b0")), (1, "f", ("a", "b"))))
    a = audit(_run(), bad)
    assert a["bit_exact"] is False and a["per_iteration_mismatches"] == [0]


def test_unhashed_iterations_are_skipped_and_rank_counts_must_match():
    skipped = copy.deepcopy(_run())
    skipped["metrics"][0]["state_hash"] = None
    assert audit(_run(), skipped)["bit_exact"] is True
    assert audit(_run(), _run(ranks=("a", "b", "c")))["rank_mismatches"] == [0, 1, 2]


def test_replica_mismatches_name_the_odd_replica():
    assert replica_mismatches(["a", "a", "b", "a"], [(0, 1, 2, 3)]) == [2]
    assert replica_mismatches(["a", "b"], [(0, 1)]) == [1]  # a tie: the lowest rank holds it
    assert replica_mismatches(["a", "b", "c", "c"], [(0, 1), (2, 3)]) == [1]
    assert replica_mismatches(["a", "b"], []) == []


def test_a_flipped_byte_in_rank_1_after_a_recovery_fails_the_audit_naming_the_rank(tmp_path):
    faults = ["kill:rank=1,iter=3,phase=update", "bitflip:rank=1,iter=7,phase=boundary"]
    s = run_job(tiny_job(iterations=8, inject=faults), tmp_path, reference=True, quiet=True)
    assert s["state"] == "done" and s["failures_recovered"] == s["failures_detected"] == 1
    assert s["faults_not_fired"] == []
    # Rank 0's state — all the old audit looked at — is the reference's: only rank 1 differs.
    assert s["final_state_hash"] == s["reference_state_hash"]
    assert s["bit_exact"] is False
    assert s["rank_mismatches"] == [1]
    assert s["per_rank_mismatches"] == [{"iter": 7, "ranks": [1]}]
    assert s["replica_mismatches"] == [{"iter": 7, "ranks": [1]}]
