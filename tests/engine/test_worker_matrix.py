"""The slow tier: the equivalence matrix of issue #5 on 8 local gloo processes.

TP ∈ {1, 2, 4}, PP ∈ {1, 2, 4}, DP ∈ {1, 2} within 8 ranks, schedules cycled over the layouts,
plus TP 8, mixed-TP pipelines and replicas with different TP degrees; tolerances as in `test_worker_equivalence`. Also checks that
the interpreter refuses a plan whose chunk routing would make a receiving TP group all-gather
its slices in the wrong order. Run with ``.venv/bin/pytest tests/engine -m slow``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests.engine.harness import Case, bit_equal, engine_job, reference, run_plans
from tests.engine.test_worker_equivalence import _assert_close
from unbroken.parallel import make_plan

pytestmark = pytest.mark.slow

EXACT = engine_job(grad_clip=0.0)
EXACT_DP = engine_job(grad_clip=0.0, microbatches=2)
SCHEDULES = itertools.cycle(["1f1b", "gpipe", "zb_h1"])


def _matrix() -> list[Case]:
    cases = []
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2)):
        if tp * pp * dp > 8:
            continue
        schedule = "1f1b" if pp == 1 else next(SCHEDULES)
        cfg = EXACT_DP if dp == 2 else EXACT
        plan = make_plan(dp, pp, tp, 4, cfg.data.microbatches, schedule)
        cases.append(Case(f"tp{tp}-pp{pp}-dp{dp}-{schedule}", plan, cfg))
    mixed = {
        "tp8": make_plan(1, 1, 8, 4, 4, "1f1b"),
        "tp4to1": make_plan(1, 2, [4, 1], 4, 4, "1f1b"),
        "tp1to4": make_plan(1, 2, [1, 4], 4, 4, "gpipe"),
        "tp2to4": make_plan(1, 2, [2, 4], 4, 4, "zb_h1"),
        "tp1-2-4-1": make_plan(1, 4, [1, 2, 4, 1], 4, 4, "1f1b"),
        "tp2-interleaved": make_plan(1, 2, 2, 4, 4, "interleaved_1f1b", virtual_stages=2),
        "tp2to1-interleaved": make_plan(1, 2, [2, 1], 4, 4, "interleaved_1f1b", virtual_stages=2),
    }
    cases += [Case(name, plan, EXACT) for name, plan in mixed.items()]
    cases.append(Case("tp2to1-dp2", make_plan(2, 2, [2, 1], 4, 2, "1f1b"), EXACT_DP))
    unequal = {  # replicas with different TP degrees: averaged at the finest shard
        "dp2-tp22-and-tp11": make_plan(2, 2, [[2, 2], [1, 1]], 4, 2, "1f1b"),
        "dp2-tp21-and-tp12": make_plan(2, 2, [[2, 1], [1, 2]], 4, 2, "zb_h1"),
        "dp2-tp4-and-tp2": make_plan(2, 1, [[4], [2]], 4, 2, "1f1b"),
    }
    cases += [Case(name, plan, EXACT_DP) for name, plan in unequal.items()]
    return cases


MATRIX = _matrix()


def test_equivalence_matrix(tmp_path):
    outcomes = run_plans(MATRIX, 8, tmp_path)
    refs = {1: reference(EXACT, 1, 2), 2: reference(EXACT_DP, 2, 2)}
    failures = []
    for case in MATRIX:
        plan = case.plan
        all_tp1 = all(g.tp == 1 for rep in plan.replicas for g in rep.stages)
        try:
            _assert_close(outcomes[case.name], refs[plan.dp], exact=all_tp1)
            for d in range(1, plan.dp):
                assert bit_equal(outcomes[case.name].params[d], outcomes[case.name].params[0])
        except AssertionError as exc:
            failures.append(f"{case.name}: {exc}")
    assert not failures, "\n".join(failures)


def test_misrouted_chunks_are_refused(tmp_path):
    """Swap which receiver of a 1 -> 2 transfer takes which half: both ends still agree, so
    the transfer completes, but the all-gather would assemble the halves in the wrong order."""
    plan = make_plan(1, 2, [1, 2], 4, 4, "1f1b")
    swapped = {}
    for rank, acts in plan.actions.items():
        new = []
        for a in acts:
            if a.kind.name in ("SEND_F", "RECV_F") and a.num_chunks == 2:
                a = dataclasses.replace(a, chunk=1 - a.chunk)
            new.append(a)
        swapped[rank] = tuple(new)
    broken = dataclasses.replace(plan, actions=swapped)
    with pytest.raises(
        AssertionError, match=r"TP position [01] of 2 received chunks \[[01]\] of 2"
    ):
        run_plans([Case("misrouted", broken, EXACT, iterations=1)], 3, tmp_path)
