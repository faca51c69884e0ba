"""The audit's verdict (`build_summary`'s `bit_exact` and `per_iteration_mismatches`) on
hand-built runs, with its negative controls: a run that differs in one hash, or that has no
hash at all, is never called exact."""

from __future__ import annotations

import pytest

from unbroken.metrics.summary import build_summary

CONFIG = {
    "train": {"iterations": 4},
    "checkpoint": {"interval": 0, "mttf_s": 0.0},
    "parallel": {"world_size": 2},
    "recovery": {"mode": "inplace"},
    "inject": [],
}


def _run(hashes: list[str | None], final: str | None, redo: dict[int, str] | None = None) -> dict:
    """A run whose iteration i recorded `hashes[i]` (None: not hashed), then `redo`'s
    iterations again (a second attempt after a recovery), ending with `final`."""
    rows = [(i, h) for i, h in enumerate(hashes)] + sorted((redo or {}).items())
    metrics = [
        {
            "iter": i,
            "t_start": float(n),
            "t_end": n + 0.5,
            "iter_s": 0.5,
            "tokens_per_s": 100.0,
            "loss": 1.0,
            "state_hash": h,
        }
        for n, (i, h) in enumerate(rows)
    ]
    return {"metrics": metrics, "events": [], "final_state_hash": final, "state": "done"}


HASHES = ["a0", "a1", "a2", "a3"]


def test_identical_runs_are_bit_exact():
    s = build_summary(_run(HASHES, "a3"), _run(HASHES, "a3"), CONFIG)
    assert s["bit_exact"] is True
    assert s["per_iteration_mismatches"] == []
    assert s["reference_state_hash"] == s["final_state_hash"] == "a3"


def test_a_different_final_hash_is_not_bit_exact():
    s = build_summary(_run(HASHES, "a3"), _run(HASHES, "a4"), CONFIG)
    assert s["bit_exact"] is False


@pytest.mark.parametrize(
    ("reference", "faulty"), [(None, None), ("a3", None), (None, "a3"), ("", "")]
)
def test_a_missing_hash_is_never_bit_exact(reference, faulty):
    """A run that never finished (no trainer_done) has no final hash; two missing hashes are
    not two equal states."""
    s = build_summary(_run(HASHES, reference), _run(HASHES, faulty), CONFIG)
    assert s["bit_exact"] is False


def test_an_iteration_that_differed_is_named_even_when_the_final_hashes_agree():
    faulty = _run(["a0", "b1", "a2", "a3"], "a3")
    s = build_summary(_run(HASHES, "a3"), faulty, CONFIG)
    assert s["per_iteration_mismatches"] == [1]


def test_every_attempt_of_a_redone_iteration_is_audited():
    """Iteration 2 ran twice (a recovery redid it): a wrong first attempt is reported too."""
    faulty = _run(["a0", "a1", "x2", "a3"], "a3", redo={2: "a2"})
    s = build_summary(_run(HASHES, "a3"), faulty, CONFIG)
    assert s["per_iteration_mismatches"] == [2]
    clean = _run(HASHES, "a3", redo={2: "a2"})
    assert build_summary(_run(HASHES, "a3"), clean, CONFIG)["per_iteration_mismatches"] == []


def test_iterations_hashed_in_only_one_run_are_not_compared():
    faulty = _run(["a0", None, "a2", "a3"], "a3")
    reference = _run(["a0", "a1", None, "a3"], "a3")
    assert build_summary(reference, faulty, CONFIG)["per_iteration_mismatches"] == []


def test_without_a_reference_there_is_no_verdict():
    s = build_summary(None, _run(HASHES, "a3"), CONFIG)
    assert "bit_exact" not in s and "per_iteration_mismatches" not in s


def _pipeline_run(job: list[str], ranks: list[list[str]], generations: list[int], relaid: bool):
    """A PP2 run whose iterations from generation 1 on ran one stage (a lost stage re-planned:
    `plan_applied` with stages) when `relaid`."""
    run = _run(job, job[-1])
    for m, own, g in zip(run["metrics"], ranks, generations, strict=True):
        m["rank_hashes"], m["generation"] = own, g
    run["rank_hashes"] = ranks[-1]
    if relaid:
        run["events"] = [{"kind": "plan_applied", "generation": 1, "iter": 2, "stages": []}]
    return run


def test_after_a_pipeline_re_plan_the_job_hash_decides_not_the_ranks():
    """Two stages, then one rank holding the whole model: its own hash cannot match either
    reference rank's, the per-parameter job hash can — and still catches a difference."""
    reference = _pipeline_run(HASHES, [["r0", "s0"]] * 4, [0] * 4, relaid=False)
    ranks = [["r0", "s0"], ["r0", "s0"], ["w2"], ["w3"]]
    faulty = _pipeline_run(HASHES, ranks, [0, 0, 1, 1], relaid=True)
    s = build_summary(reference, faulty, CONFIG)
    assert s["bit_exact"] is True and s["rank_mismatches"] == []
    wrong = _pipeline_run(["a0", "a1", "a2", "x3"], ranks, [0, 0, 1, 1], relaid=True)
    s = build_summary(reference, wrong, CONFIG)
    assert s["bit_exact"] is False and s["per_iteration_mismatches"] == [3]
    # Without the re-plan's record, the same ranks are compared and differ.
    unmarked = _pipeline_run(HASHES, ranks, [0, 0, 1, 1], relaid=False)
    assert build_summary(reference, unmarked, CONFIG)["bit_exact"] is False
