"""`unbroken bench engine`: the simulator inputs it derives from timestamped spans, the stamped
profile it reads them from, and (slow tier) one small end-to-end run. Nothing here asserts a
speed; the spans are made up."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tests.engine.harness import engine_job, one_thread
from unbroken.bench import engine as bench
from unbroken.bench.engine import delivery_seconds, reduce_seconds
from unbroken.bench.engine_ranks import _StampedProfile
from unbroken.engine.build import build_worker
from unbroken.parallel import make_plan

# make_plan(1, 2, 1, 4, 2, "1f1b"), batch by batch:
#   rank 0: [0SEND_F0->r1]  [0SEND_F1->r1 0RECV_B0<-r1]  [0RECV_B1<-r1]
#   rank 1: [1RECV_F0<-r0]  [1SEND_B0->r0 1RECV_F1<-r0]  [1SEND_B1->r0]
PP2 = make_plan(1, 2, 1, 4, 2, "1f1b")
RANK0 = [(1.0, 1.5), (2.0, 4.2), (4.5, 6.4)]
RANK1 = [(0.0, 1.5), (4.0, 4.3), (6.0, 6.6)]
# Each batch's end minus the later of its own start and its peer batches' starts:
# rank 0: 1.5 - 1.0, 4.2 - 4.0, 6.4 - 6.0; rank 1: 1.5 - 1.0, 4.3 - 4.0, 6.6 - 6.0.
DELIVERY = (0.5 + 0.2 + 0.4 + 0.5 + 0.3 + 0.6) / 6


def test_delivery_counts_from_the_moment_every_transfer_of_a_batch_could_start():
    assert delivery_seconds(PP2, [RANK0, RANK1], 1) == pytest.approx(DELIVERY)


def test_delivery_pairs_batches_iteration_by_iteration():
    # A second iteration 10 s later whose batches all end 0.1 s later; ranks 2 and 3 stand by.
    later = [[(a + 10, b + 10.1) for a, b in spans] for spans in (RANK0, RANK1)]
    batches = [RANK0 + later[0], RANK1 + later[1], [], []]
    assert delivery_seconds(PP2, batches, 2) == pytest.approx(DELIVERY + 0.05)


def test_delivery_refuses_spans_that_do_not_match_the_lists():
    with pytest.raises(RuntimeError, match="rank 1 recorded 2 p2p batches over 1 iterations"):
        delivery_seconds(PP2, [RANK0, RANK1[:2]], 1)


def test_reduce_is_the_last_arrival_time_per_physical_stage():
    plan = make_plan(2, 2, 1, 4, 4, "1f1b")  # stage 0 on ranks 0 and 2, stage 1 on 1 and 3
    spans = [
        [(0.0, 5.0), (10.0, 15.0)],
        [(1.0, 2.0), (11.0, 11.5)],
        [(3.0, 5.2), (14.0, 15.1)],
        [(0.5, 2.1), (10.0, 11.6)],
    ]
    assert reduce_seconds(plan, spans, 2) == pytest.approx({0: (2.2 + 1.1) / 2, 1: (1.0 + 0.5) / 2})


def test_stamped_profile_gives_each_step_of_the_worker_its_place_in_time(world):
    """The worker appends a step's seconds as the step ends: the stamped spans follow its
    action list (every F before REDUCE_GRAD, REDUCE_GRAD before OPT_STEP) and fit in the
    iteration."""
    cfg = engine_job()
    with one_thread():
        worker = build_worker(
            cfg, make_plan(1, 1, 1, 4, cfg.data.microbatches, "1f1b"), world, device="cpu"
        ).worker
        worker.profile = profile = _StampedProfile()
        worker.run_iteration(0)
    spans = {key: steps.spans() for key, steps in profile.items()}
    assert [len(spans[k]) for k in ("F0", "B0", "REDUCE_GRAD", "OPT_STEP", "ITERATION")] == [
        cfg.data.microbatches,
        cfg.data.microbatches,
        1,
        1,
        1,
    ]
    for key, steps in profile.items():
        assert [round(b - a, 9) for a, b in spans[key]] == [round(s, 9) for s in steps], key
    (iteration,) = spans["ITERATION"]
    (reduce,) = spans["REDUCE_GRAD"]
    (step,) = spans["OPT_STEP"]
    assert iteration[0] <= spans["F0"][0][0]
    assert max(b for _, b in spans["B0"]) <= reduce[0] <= reduce[1] <= step[0]
    assert step[1] <= iteration[1]


@pytest.mark.slow
def test_bench_engine_runs_every_plan_and_predicts_it(capsys):
    """One small run of the 4-rank benchmark: every plan measured on both engines, a finite
    prediction from the delivery time of the lead-in iterations."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = "--json --tokens 64 --microbatches 4 --warmup 1 --block 1 --rounds 2"
    args = parser.parse_args(small.split())
    assert bench.run(args) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["plan"] for r in results] == list(bench._plans(args))
    for r in results:
        assert r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
        assert math.isfinite(r["predicted_iter_s"]) and r["predicted_iter_s"] > 0
        assert r["delivery_s"] > 0 and r["cpu_s"] > 0
