"""A DP x TP job shrinks a slow device's TP group live (issue 18 items 2-4 and 6, ResiHP §6.1
selective TP exclusion and Figure 8(c)), bit for bit on the launch plan.

TP = 2 x DP = 2 on 4 local ranks (the tiny model, 4 micro-batches per shard, `adapt.enabled`,
in-place recovery). Rank 0 (TP position 0 of replica 0) computes 10x slower from iteration 16:
inside a TP group a slow device holds its peer at every layer's collective, so the whole
replica runs at its pace. The fail-slow watch reports it; the scheduler's exclusion step
(k x min p: TP 1 on rank 1 scores 1, TP 2 scores 2/10) shrinks the group to rank 1, and its
migration step gives the TP-1 replica fewer micro-batches. The coordinator takes that plan at a
planned stop; the next generation moves the parameters and Adam moments to the new layout
(`RestoreMode.RESHARD`: rank 1 receives the half it did not hold, from rank 0's retained
buffers or replica 1's), no checkpoint. Rank 0 stays in the world as a rank of no stage.

The TP-1 stage computes as the TP-2 group it replaced (`unbroken.engine.emulate`), and the
ordered reduction folds each fine piece of a parameter over its holders in micro-batch order
(`unbroken.engine.ordered_plan`), so the fault-free reference on the launch plan — which never
re-plans — ends with the same bits. The second test lets the device recover: it is
re-admitted on trial after `adapt.readmit_after` iterations and the launch plan comes back the
same way.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from unbroken.config import ParallelConfig
from unbroken.metrics.log import read_jsonl

from .conftest import adapt_job, crash_recovered_after_exclusion, events_of, run_bit_exact


def _tp2_job(*, inject: list[str], readmit_after: int, iterations: int = 32):
    cfg = adapt_job(
        world_size=4,
        iterations=iterations,
        microbatches=4,
        inject=inject,
        readmit_after=readmit_after,
    )
    return dataclasses.replace(cfg, parallel=ParallelConfig(world_size=4, tp=2))


def _groups(stages) -> list[tuple[list[int], int]]:
    return [(s["ranks"], s["tp"]) for s in sorted(stages, key=lambda s: s["replica"])]


@pytest.mark.timeout(900)
def test_a_slow_device_s_tp_group_shrinks_live_bit_exact(tmp_path):
    cfg = _tp2_job(inject=["slow:rank=0,iter=16,factor=10"], readmit_after=100)
    s, events = run_bit_exact(cfg, tmp_path)
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["kind"] == "fail_slow" and replan["trigger"]["rank"] == 0
    assert replan["restore"] == "reshard"
    assert _groups(replan["before"]) == [([0, 1], 2), ([2, 3], 2)]
    assert _groups(replan["after"]) == [([1], 1), ([2, 3], 2)]
    assert replan["counts_after"][0] < replan["counts_after"][1]
    assert events_of(events, "checkpoint_loaded") == []
    (benched,) = events_of(events, "device_excluded")
    assert benched["device"] == 0 and benched["readmit_at"] > 32
    moved = events_of(events, "state_moved")
    assert sorted(e["rank"] for e in moved) == [0, 1, 2, 3]
    by_rank = {e["rank"]: e for e in moved}
    assert by_rank[1]["bytes_in"] > 0  # the half of every split tensor rank 1 did not hold
    # Nothing else reported slow: the TP-1 rank does its group's work, paced as such.
    assert [e["rank"] for e in events_of(events, "fail_slow")] == [0]
    (record,) = s["replans"]
    assert record["tp_after"] == [1, 2] and record["restore"] == "reshard"
    # Faster than the slow iterations before it (the record's window before the switch is
    # mostly healthy iterations: the report comes 1-2 iterations after the slowdown).
    rows = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["run"] == "faulty"]
    slow = [m["iter_s"] for m in rows if 16 <= m["iter"] < record["iter"]]
    after = [m["iter_s"] for m in rows if m["iter"] > record["iter"]]
    assert slow and statistics.median(after) < statistics.median(slow)


@pytest.mark.timeout(900)
def test_a_benched_device_at_full_speed_again_gets_its_tp_shard_back_bit_exact(tmp_path):
    cfg = _tp2_job(
        inject=["slow:rank=0,iter=16,factor=10,until=24"], readmit_after=4, iterations=40
    )
    _, events = run_bit_exact(cfg, tmp_path)
    shrink, back = events_of(events, "replan")[:2]
    assert _groups(shrink["after"]) == [([1], 1), ([2, 3], 2)]
    assert back["trigger"]["kind"] == "readmit_trial" and back["trigger"]["device"] == 0
    assert back["restore"] == "reshard"
    assert _groups(back["after"]) == [([0, 1], 2), ([2, 3], 2)]
    assert list(back["counts_after"]) == [4, 4]
    assert events_of(events, "checkpoint_loaded") == []
    (readmitted,) = events_of(events, "device_readmitted")
    assert readmitted["device"] == 0


@pytest.mark.timeout(900)
def test_a_crash_of_the_shrunk_groups_rank_after_the_exclusion_is_recovered_in_place(tmp_path):
    """Rank 1, alone in replica 0's group since the exclusion (computing as TP 2), is killed
    inside its update: its shadow takes over on the state it retained under the new layout,
    the standby rank 0 restores beside it, no checkpoint, still bit for bit."""
    cfg = _tp2_job(
        inject=["slow:rank=0,iter=16,factor=10", "kill:rank=1,iter=26,phase=update"],
        readmit_after=100,
    )
    replan, applied = crash_recovered_after_exclusion(cfg, tmp_path)
    assert _groups(replan["after"]) == [([1], 1), ([2, 3], 2)]
    # The generation after the kill runs the shrunk plan, restored in place.
    last = applied[max(applied)]
    assert max(applied) >= 2 and _groups(last["stages"]) == [([1], 1), ([2, 3], 2)]


@pytest.mark.timeout(900)
def test_a_kill_while_the_state_moves_to_the_shrunk_group_restarts_under_it_from_a_checkpoint(
    tmp_path,
):
    """A second failure during the reconfiguration: rank 1 dies moving the state. The regions
    may hold two layouts, so the next generation loads the newest checkpoint (iteration 0 here)
    resharded to the shrunk plan — the standby rank 0 included — and ends bit for bit."""
    cfg = _tp2_job(
        inject=["slow:rank=0,iter=16,factor=10", "kill:rank=1,iter=1,phase=move,step=0"],
        readmit_after=100,
    )
    _, events = run_bit_exact(cfg, tmp_path)
    (replan,) = events_of(events, "replan")
    assert replan["restore"] == "reshard"
    assert _groups(replan["after"]) == [([1], 1), ([2, 3], 2)]
    assert events_of(events, "state_moved") == []  # rank 1 died before any rank finished
    assert events_of(events, "checkpoint_loaded")
    applied = [e for e in events_of(events, "plan_applied") if "stages" in e]
    assert _groups(applied[-1]["stages"]) == [([1], 1), ([2, 3], 2)]


@pytest.mark.timeout(900)
def test_a_benched_device_lost_for_good_leaves_the_shrunk_plan_running_in_place(tmp_path):
    """Device 0, standing by inside the world since its group shrank (a rank of no stage), is
    lost: the others keep the shrunk plan and their state, in place, no checkpoint, and the
    run ends bit for bit."""
    cfg = _tp2_job(
        inject=["slow:rank=0,iter=16,factor=10", "lose:rank=0,iter=26,phase=update"],
        readmit_after=100,
    )
    _, events = run_bit_exact(cfg, tmp_path)
    shrink, lost = events_of(events, "replan")
    assert _groups(shrink["after"]) == [([1], 1), ([2, 3], 2)]
    assert lost["trigger"]["kind"] == "device_lost" and lost["restore"] == "in_place"
    assert lost["devices_after"] == [1, 2, 3] and _groups(lost["after"]) == [([0], 1), ([1, 2], 2)]
    assert events_of(events, "checkpoint_loaded") == []
