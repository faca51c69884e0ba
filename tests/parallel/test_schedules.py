"""Schedules: coherent action lists and the textbook iteration times at unit costs."""

from collections import Counter

import pytest

from unbroken.parallel import (
    ActionKind,
    check_plan,
    compute_orders,
    make_plan,
    p2p_chunks,
    simulate,
    transfer_key,
)

from .helpers import unit_costs

GRID = [(pp, m) for pp in (1, 2, 4) for m in (1, 4, 8)]
SCHEDULE_V = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


def _plan(schedule: str, v: int, pp: int, m: int, dp: int = 1, tp: object = 1):
    return make_plan(
        dp=dp, pp=pp, tp=tp, num_layers=16, microbatches=m, schedule=schedule, virtual_stages=v
    )


@pytest.mark.parametrize(("schedule", "v"), SCHEDULE_V)
@pytest.mark.parametrize(("pp", "m"), GRID)
def test_action_lists_are_coherent(schedule: str, v: int, pp: int, m: int) -> None:
    if schedule == "interleaved_1f1b" and m % pp:
        with pytest.raises(ValueError, match="multiple of pp"):
            _plan(schedule, v, pp, m)
        return
    plan = _plan(schedule, v, pp, m, dp=2)
    assert check_plan(plan) == []
    for rank, acts in plan.actions.items():
        seen = set()
        for a in acts:
            if a.kind is ActionKind.B:
                assert (a.stage, a.microbatch) in seen, f"r{rank}: {a} before its F"
            if a.kind is ActionKind.F:
                seen.add((a.stage, a.microbatch))
        assert [str(a) for a in acts[-2:]] == ["REDUCE_GRAD", "OPT_STEP"]
        computes = Counter(a.kind for a in acts if a.is_compute)
        assert computes[ActionKind.F] == computes[ActionKind.B] == m * v
        assert computes[ActionKind.W] == (m if schedule == "zb_h1" else 0)
    sends = Counter(
        transfer_key(r, a) for r, acts in plan.actions.items() for a in acts if a.is_send
    )
    recvs = Counter(
        transfer_key(r, a)
        for r, acts in plan.actions.items()
        for a in acts
        if a.is_comm and not a.is_send
    )
    assert sends == recvs and set(sends.values()) <= {1}
    for mode in ("eager", "rendezvous"):
        assert simulate(plan, unit_costs(1, 2), sends=mode).ok


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), GRID)
def test_gpipe_and_1f1b_take_m_plus_s_minus_1_slots(schedule: str, pp: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    timeline = simulate(_plan(schedule, 1, pp, m, dp=2), unit_costs(tf, tb))
    assert timeline.iteration_time == (m + pp - 1) * (tf + tb)
    assert timeline.busy[0] == m * (tf + tb)
    assert timeline.bubble[0] == (pp - 1) * (tf + tb)


@pytest.mark.parametrize(("pp", "m"), [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_v(pp: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0  # per model chunk; a whole stage costs v times that
    inter = simulate(_plan("interleaved_1f1b", v, pp, m), unit_costs(f, b)).iteration_time
    plain = make_plan(dp=1, pp=pp, tp=1, num_layers=16, microbatches=m, schedule="1f1b")
    flat = simulate(plain, unit_costs(v * f, v * b)).iteration_time
    work = m * v * (f + b)
    assert inter == (m * v + pp - 1) * (f + b)
    assert (flat - work) == pytest.approx(v * (inter - work))


@pytest.mark.parametrize(("pp", "m"), GRID)
def test_zb_h1_shrinks_the_bubble(pp: int, m: int) -> None:
    costs = unit_costs(1, 1, 1)  # F = B(input grad) = W(weight grad)
    zb = simulate(_plan("zb_h1", 1, pp, m), costs).iteration_time
    one = simulate(_plan("1f1b", 1, pp, m), costs).iteration_time
    assert one == (m + pp - 1) * 3  # 1F1B's backward is B + W
    if pp > 1:
        assert zb < one
    if m >= pp:  # (p - 1)(F + B - W) bubble, the zero-bubble paper's H1 figure
        assert zb == 3 * m + (pp - 1) * (1 + 1 - 1)


def test_zb_h1_keeps_1f1b_activation_bound() -> None:
    pp, m = 4, 8
    orders = compute_orders([[(s,) for s in range(pp)]], [m], "zb_h1")
    for (_, s), order in orders.items():
        live, deferred = 0, 0
        for kind, _, _ in order:
            live += {ActionKind.F: 1, ActionKind.B: -1}.get(kind, 0)
            deferred += {ActionKind.B: 1, ActionKind.W: -1}.get(kind, 0)
            assert live <= pp - s and deferred <= pp


def test_p2p_chunks_follow_resihp_figure_7() -> None:
    assert p2p_chunks((0, 1), (2,)) == [(0, 0, 2), (1, 1, 2)]
    assert p2p_chunks((0,), (1, 2)) == [(0, 0, 1), (1, 0, 2)]
    assert p2p_chunks((0, 1), (2, 3)) == [(0, 0, 2), (1, 1, 3)]
    assert p2p_chunks((0, 1, 2, 3), (4, 5)) == [(0, 0, 4), (1, 1, 4), (2, 2, 5), (3, 3, 5)]
    assert p2p_chunks((0,), (1,)) == [(0, 0, 1)]


def test_heterogeneous_tp_sends_each_chunk_once() -> None:
    plan = make_plan(dp=1, pp=2, tp=[2, 1], num_layers=4, microbatches=1, schedule="gpipe")
    assert [str(a) for a in plan.actions[0] if a.is_comm] == [
        "0SEND_F0[0/2]->r2",
        "0RECV_B0[0/2]<-r2",
    ]
    assert [str(a) for a in plan.actions[1] if a.is_comm] == [
        "0SEND_F0[1/2]->r2",
        "0RECV_B0[1/2]<-r2",
    ]
    assert [str(a) for a in plan.actions[2] if a.is_comm] == [
        "1RECV_F0[0/2]<-r0",
        "1RECV_F0[1/2]<-r1",
        "1SEND_B0[0/2]->r0",
        "1SEND_B0[1/2]->r1",
    ]
    # Both TP ranks run the same compute.
    assert [a for a in plan.actions[0] if a.is_compute] == [
        a for a in plan.actions[1] if a.is_compute
    ]
    # Each half-message costs half the link time: 1 (F) + 0.5 + 1 + 1 (B) + 0.5 + 1 = 5.
    hetero = simulate(plan, unit_costs(1, 1, link=1.0))
    assert hetero.ok and hetero.iteration_time == 5.0
    same = make_plan(dp=1, pp=2, tp=1, num_layers=4, microbatches=1, schedule="gpipe")
    assert simulate(same, unit_costs(1, 1, link=1.0)).iteration_time == 6.0


def test_one_to_two_scatters_over_receivers() -> None:
    plan = make_plan(dp=1, pp=2, tp=[1, 2], num_layers=4, microbatches=2, schedule="1f1b")
    sends = [str(a) for a in plan.actions[0] if a.kind is ActionKind.SEND_F]
    assert sends == [
        "0SEND_F0[0/2]->r1",
        "0SEND_F0[1/2]->r2",
        "0SEND_F1[0/2]->r1",
        "0SEND_F1[1/2]->r2",
    ]
    assert simulate(plan, unit_costs(1, 2, link=0.5)).ok
