"""A DP x PP job moves layers off a slow device in its replica alone (issue 18 items 2-4,
ResiHP §6.2 and Figure 8): the replicas then run two layouts, the state moves between the
ranks' retained buffers, no checkpoint, and the run stays bit for bit on the launch plan's.

PP = 2 x DP = 2 on 4 local ranks, the tiny model with 4 layers, 4 micro-batches per shard,
`adapt.enabled`, in-place recovery, exclusion off (`adapt.readmit_after = 0`: a device too slow
for its own step would otherwise leave the world, tests/adapt/test_pipeline_exclusion.py). Rank 0
(replica 0, layers 0-1 and the embedding) runs 2x slower from iteration 16. The fail-slow watch
reports it; the scheduler's plan repartitions replica 0 alone — `[0, 1) [1, 4)` beside replica
1's `[0, 2) [2, 4)` — and moves micro-batches to replica 1; the coordinator stops the generation
at a planned stop and the next one (`RestoreMode.RESHARD`) moves parameters and both Adam moments
to the new layout (`unbroken.launch.relayout`). The ordered reduction folds each parameter's
gradient over its holders in micro-batch id order wherever they hold it
(`unbroken.engine.ordered_plan`), so the reference — the fault-free run on the launch plan,
which never re-plans — ends with the same bits.

The decision's edges (a faster exclusion, the layers given back at full speed) are decision
tests in test_pipeline_adaptation.py; the fold of two layouts alone is in
tests/engine/test_ordered_plans.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.config import ModelConfig, ParallelConfig

from .conftest import adapt_job, events_of, run_bit_exact


def _layouts(stages) -> list[list[tuple[int, int]]]:
    replicas: dict[int, list[tuple[int, int]]] = {}
    for s in stages:
        replicas.setdefault(s["replica"], []).append(tuple(s["layers"]))
    return [replicas[d] for d in sorted(replicas)]


@pytest.mark.timeout(900)
def test_a_dp_x_pp_job_moves_the_slow_replicas_layers_alone_bit_exact(tmp_path):
    cfg = adapt_job(
        world_size=4,
        iterations=32,
        microbatches=4,
        inject=["slow:rank=0,iter=16,factor=2"],
        readmit_after=0,
    )
    cfg = dataclasses.replace(
        cfg,
        model=ModelConfig(preset="tiny", n_layers=4),
        parallel=ParallelConfig(world_size=4, pp=2),
    )
    s, events = run_bit_exact(cfg, tmp_path)
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["kind"] == "fail_slow" and replan["trigger"]["rank"] == 0
    assert replan["restore"] == "reshard"
    assert _layouts(replan["before"]) == [[(0, 2), (2, 4)], [(0, 2), (2, 4)]]
    after = _layouts(replan["after"])
    assert after[0] != after[1] and after[1] == [(0, 2), (2, 4)], after  # replica 0 alone
    assert after[0][0][1] < 2  # fewer layers on the slow rank
    assert replan["counts_after"][0] < replan["counts_after"][1]
    moved = events_of(events, "state_moved")
    assert sorted(e["rank"] for e in moved) == [0, 1, 2, 3]
    assert {e["iter"] for e in moved} == {moved[0]["iter"]}
    assert sum(e["bytes_in"] for e in moved) > 0  # a layer's state crossed between ranks
    assert events_of(events, "checkpoint_loaded") == []
    assert s["recoveries"] == [] or all(r.get("planned") for r in s["recoveries"]), s["recoveries"]
    # Nothing else reported slow in the new layouts (ranks compared per layer they hold).
    assert [e["rank"] for e in events_of(events, "fail_slow")] == [0]
