"""A reference model with tied embedding and head (`model.tie_embeddings`) on plans: where the
first and last layers are on different ranks, the first stage owns the embedding and the last
stage holds a copy; their gradients are summed across the stages (`unbroken.engine.tied`) and
the copy is left out of the global gradient norm. The result matches the single-process tied
model, whose one parameter gets the sum of both uses' gradients from autograd.

"Matches": to within the tolerances of `test_worker_equivalence` for TP > 1 — with a tie even
TP-1 pipelines sum in another order (per stage over the micro-batches, then across the stages;
the single-process model sums both uses per micro-batch), so the gradients agree to ~1e-7, not
bit for bit. The two copies themselves are bit-identical, and so are replicas.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.harness import Case, bit_equal, engine_job, max_abs_diff, reference, run_plans
from unbroken.parallel import make_plan

GRAD_ATOL = 1e-6
PARAM_ATOL = 2e-5


def _tied(microbatches: int):
    cfg = engine_job(microbatches=microbatches, grad_clip=1.0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True))


TIED, TIED_DP = _tied(4), _tied(2)

CASES = [
    Case("tied-pp2-1f1b", make_plan(1, 2, 1, 4, 4, "1f1b"), TIED),
    Case("tied-pp2-zb_h1", make_plan(1, 2, 1, 4, 4, "zb_h1"), TIED),
    Case(
        "tied-pp2-interleaved",
        make_plan(1, 2, 1, 4, 4, "interleaved_1f1b", virtual_stages=2),
        TIED,
    ),
    Case("tied-pp2-dp2", make_plan(2, 2, 1, 4, 2, "1f1b"), TIED_DP),
    Case("tied-tp2-pp2", make_plan(1, 2, 2, 4, 4, "1f1b"), TIED),
    Case("tied-tp2", make_plan(1, 1, 2, 4, 4, "1f1b"), TIED),
    Case(  # one parameter under two names on one rank, then a copy on the new last stage
        "tied-replan-pp1-to-pp2",
        make_plan(1, 1, 1, 4, 4),
        TIED,
        iterations=1,
        then=make_plan(1, 2, 1, 4, 4),
    ),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_plans(CASES, 4, tmp_path_factory.mktemp("engine-tied"))


@pytest.fixture(scope="module")
def ref():
    cache = {}

    def get(case: Case):
        n = case.iterations + (case.after if case.then is not None else 0)
        dp = case.final_plan.dp
        key = (id(case.cfg), dp, n)
        if key not in cache:
            cache[key] = reference(case.cfg, dp, n)
        return cache[key]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_tied_model_on_a_plan_matches_the_single_process_model(outcomes, ref, case):
    got, expected = outcomes[case.name], ref(case)
    assert got.losses == pytest.approx(expected.losses, rel=1e-6)
    # the copy is not counted twice in the global norm (that would be off by far more)
    assert got.grad_norms == pytest.approx(expected.grad_norms, rel=1e-5)
    for grads, params in zip(got.grads, got.params, strict=True):
        assert max_abs_diff(grads, expected.grads[0]) <= GRAD_ATOL
        assert max_abs_diff(params, expected.params[0]) <= PARAM_ATOL
        # the embedding and its copy on the last stage: summed and updated alike
        assert bit_equal({"w": grads["head.weight"]}, {"w": grads["embed.weight"]})
        assert bit_equal({"w": params["head.weight"]}, {"w": params["embed.weight"]})
        assert float(grads["embed.weight"].abs().max()) > 0
    for params in got.params[1:]:
        assert bit_equal(params, got.params[0]), "replicas diverged"
