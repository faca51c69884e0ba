"""The dry-run simulator: timings, critical path, costs, and broken lists flagged, not hung."""

import csv
import dataclasses
import io
import itertools
import math

import pytest

from unbroken.parallel import (
    Costs,
    DeadlockError,
    Migration,
    NodeLinks,
    iteration_time,
    make_plan,
    parse_action,
    simulate,
    timeline_csv,
)

from .helpers import index_of, unit_costs, with_actions


def _1f1b(pp: int = 2, m: int = 4, **kw: object):
    return make_plan(dp=1, pp=pp, tp=1, num_layers=8, microbatches=m, schedule="1f1b", **kw)


def test_swapped_receives_are_flagged() -> None:
    plan = _1f1b()
    acts = list(plan.actions[1])
    i, j = index_of(plan, 1, "1RECV_F1<-r0"), index_of(plan, 1, "1RECV_F2<-r0")
    acts[i], acts[j] = acts[j], acts[i]
    broken = with_actions(plan, 1, acts)
    timeline = simulate(broken, unit_costs())
    assert not timeline.ok
    reasons = [(p.rank, p.index, p.reason) for p in timeline.deadlocks]
    assert any((r, k) == (1, i) and "misordered" in why for r, k, why in reasons)
    assert any("deadlock with blocking sends" in why for _, _, why in reasons)
    blocking = simulate(broken, unit_costs(), sends="rendezvous")
    assert math.isinf(blocking.iteration_time)
    assert {p.rank for p in blocking.deadlocks if p.reason.startswith("stuck")} == {0, 1}


def test_dropped_send_is_flagged_and_the_replay_stops() -> None:
    plan = _1f1b()
    acts = [a for a in plan.actions[0] if str(a) != "0SEND_F2->r1"]
    timeline = simulate(with_actions(plan, 0, acts), unit_costs())
    assert math.isinf(timeline.iteration_time)
    recv = index_of(plan, 1, "1RECV_F2<-r0")
    flagged = [p for p in timeline.deadlocks if (p.rank, p.index) == (1, recv)]
    assert any("no matching SEND" in p.reason for p in flagged)
    assert any(p.reason.startswith("stuck") for p in flagged)
    with pytest.raises(DeadlockError, match="no matching SEND"):
        iteration_time(with_actions(plan, 0, acts), unit_costs())


def test_wrong_peer_is_flagged_on_both_ends() -> None:
    plan = _1f1b(pp=4)
    acts = [
        dataclasses.replace(a, peer=2) if str(a) == "0SEND_F1->r1" else a for a in plan.actions[0]
    ]
    timeline = simulate(with_actions(plan, 0, acts), unit_costs())
    text = [str(p) for p in timeline.deadlocks]
    assert any(
        t.startswith("r0[") and "0SEND_F1->r2: SEND with no matching RECV on r2" in t for t in text
    )
    assert any("1RECV_F1<-r0: RECV with no matching SEND on r0" in t for t in text)


def test_send_cycle_hangs_only_with_blocking_sends() -> None:
    """Each rank sends before it receives, in separate batches: fine eagerly, a hang on NCCL."""
    plan = make_plan(dp=1, pp=2, tp=1, num_layers=2, microbatches=3, schedule="zb_h1")
    rank0 = (
        "0F0 0SEND_F0->r1 0F1 0SEND_F1->r1 0F2 0SEND_F2->r1 0RECV_B0<-r1 0B0 "
        "0RECV_B1<-r1 0B1 0RECV_B2<-r1 0B2 REDUCE_GRAD OPT_STEP"
    )
    rank1 = (
        "1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0 1W0 1RECV_F1<-r0 1F1 1B1 1SEND_B1->r0 1W1 "
        "1RECV_F2<-r0 1F2 1B2 1SEND_B2->r0 1W2 REDUCE_GRAD OPT_STEP"
    )
    cyclic = dataclasses.replace(
        plan,
        actions={
            0: tuple(map(parse_action, rank0.split())),
            1: tuple(map(parse_action, rank1.split())),
        },
    )
    timeline = simulate(cyclic, unit_costs())
    assert math.isfinite(timeline.iteration_time)
    stuck = {(p.rank, str(p.action)) for p in timeline.deadlocks}
    assert stuck == {(0, "0SEND_F1->r1"), (1, "1SEND_B0->r0")}
    assert all("blocking sends" in p.reason for p in timeline.deadlocks)


def test_missing_compute_on_one_tp_rank_blocks_its_group() -> None:
    plan = make_plan(dp=1, pp=1, tp=2, num_layers=2, microbatches=2)
    acts = [a for a in plan.actions[1] if str(a) != "0F1"]
    timeline = simulate(with_actions(plan, 1, acts), unit_costs())
    assert not timeline.ok and math.isinf(timeline.iteration_time)
    assert any("missing" in p.reason and p.rank == 1 for p in timeline.deadlocks)
    assert any("waiting for r1" in p.reason and p.rank == 0 for p in timeline.deadlocks)


@pytest.mark.parametrize("sends", ["eager", "rendezvous"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_critical_path_is_a_tight_chain(sends: str, schedule: str) -> None:
    plan = make_plan(dp=2, pp=4, tp=[1, 2, 1, 1], num_layers=8, microbatches=6, schedule=schedule)
    costs = Costs(
        compute=lambda w: {"F": 1.0, "B": 2.0, "W": 0.5}[w.kind] * (1.5 if w.stage == 2 else 1.0),
        link=0.25,
        reduce_grad=0.5,
        opt_step=0.1,
    )
    timeline = simulate(plan, costs, sends=sends)  # type: ignore[arg-type]
    assert timeline.ok
    path = timeline.critical_path
    assert path[0].start == 0.0 and path[-1].end == timeline.iteration_time
    for before, after in itertools.pairwise(path):
        # A receive that waited for data starts when its rank reached it, before the data came.
        assert after.start == pytest.approx(before.end) or after.action.is_comm
        assert after.start >= before.start
    assert str(path[-1].action) == "OPT_STEP"


def test_slow_tp_member_slows_its_group() -> None:
    plan = make_plan(dp=1, pp=1, tp=2, num_layers=2, microbatches=4)
    assert iteration_time(plan, unit_costs(1, 2)) == 12.0
    slowed = dataclasses.replace(unit_costs(1, 2), slowdown={1: 2.0})
    timeline = simulate(plan, slowed)
    assert timeline.iteration_time == 24.0 and timeline.busy[0] == timeline.busy[1] == 24.0


def test_per_microbatch_and_per_work_costs() -> None:
    plan = make_plan(dp=1, pp=1, tp=1, num_layers=3, microbatches=3)
    table = {(0, "F"): 1.0, (0, "B"): 1.0, (0, "F", 1): 4.0}
    assert iteration_time(plan, Costs(compute=table)) == 9.0
    seen = []

    def by_layers(work):  # cost proportional to the stage's layers
        seen.append(work)
        return 0.0 if work.kind == "W" else float(work.layers[1] - work.layers[0])

    two = make_plan(dp=1, pp=2, tp=1, num_layers=3, microbatches=1, layer_split=[1, 2])
    assert iteration_time(two, Costs(compute=by_layers)) == 1 + 2 + 2 + 1
    assert {(w.stage, w.layers, w.ranks) for w in seen} == {(0, (0, 1), (0,)), (1, (1, 3), (1,))}
    with pytest.raises(ValueError, match="no compute cost"):
        simulate(plan, Costs(compute={(0, "F"): 1.0}))


def test_node_links_charge_intra_and_inter_node() -> None:
    links = NodeLinks(
        ranks_per_node=2, intra_bandwidth=10.0, inter_bandwidth=1.0, inter_latency=0.5
    )
    assert links(0, 1, 10.0) == 1.0 and links(1, 2, 10.0) == 10.5
    plan = make_plan(dp=1, pp=4, tp=1, num_layers=4, microbatches=1, schedule="gpipe")
    costs = unit_costs(1, 1, link=links, message_bytes=10.0)
    # 4 F + 4 B, three hops each way: two within a node (1.0), one across (10.5).
    assert iteration_time(plan, costs) == 8 + 2 * (1.0 + 10.5 + 1.0)


def test_gradient_reduction_waits_for_the_slowest_replica() -> None:
    plan = make_plan(dp=2, pp=1, tp=1, num_layers=2, microbatches=[4, 6])
    timeline = simulate(plan, unit_costs(1, 1, reduce_grad=2.0, opt_step=1.0))
    by_action = {(t.rank, str(t.action)): t for t in timeline.actions}
    assert by_action[(0, "REDUCE_GRAD")].start == 12.0  # replica 1 finishes its 6 at 12
    assert timeline.iteration_time == 15.0
    assert timeline.bubble[0] == 15.0 - 8.0


def test_migration_times_the_overloaded_group() -> None:
    """Replica 1's stage 1 failed: its micro-batches 2 and 3 run on replica 0's stage 1."""
    moves = [Migration(2, 1, 0), Migration(3, 1, 0)]
    plan = make_plan(dp=2, pp=2, tp=1, num_layers=2, microbatches=2, migrations=moves)
    assert [str(a) for a in plan.actions[3]] == ["REDUCE_GRAD", "OPT_STEP"]
    computes = [str(a) for a in plan.actions[1] if a.is_compute]
    assert computes == ["1F0", "1B0", "1F2", "1B2", "1F1", "1B1", "1F3", "1B3"]
    timeline = simulate(plan, unit_costs(1, 1))
    assert timeline.ok
    assert timeline.busy[1] == 8.0 and timeline.busy[3] == 0.0
    assert timeline.iteration_time == 10.0  # healthy: (2 + 2 - 1) * 2 = 6
    healthy = make_plan(dp=2, pp=2, tp=1, num_layers=2, microbatches=2)
    assert iteration_time(healthy, unit_costs(1, 1)) == 6.0


def test_timeline_csv() -> None:
    plan = _1f1b()
    timeline = simulate(plan, unit_costs(1, 2))
    rows = list(csv.DictReader(io.StringIO(timeline_csv(timeline))))
    assert len(rows) == sum(len(a) for a in plan.actions.values())
    assert rows[0] == {"rank": "0", "index": "0", "action": "0F0", "start": "0.0", "end": "1.0"}
    assert max(float(r["end"]) for r in rows) == timeline.iteration_time


def test_unknown_send_mode() -> None:
    with pytest.raises(ValueError, match="sends"):
        simulate(_1f1b(), unit_costs(), sends="buffered")  # type: ignore[arg-type]
