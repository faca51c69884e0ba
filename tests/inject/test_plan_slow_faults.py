"""`slow` faults on a hybrid-parallel plan's rank ([Note: slow-fault] in
`unbroken.inject.injector`, [Note: plan hooks] in `unbroken.engine.interpreter`): a compute
fault stretches the rank's own work, not its waits for peers; a comm fault becomes active and
stalls after the rank's sending p2p batches and its gradient reduction, inside their time.
First the injector against fake clocks, then real gloo ranks (`tests.engine.hooked`)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.engine.harness import engine_job
from tests.engine.hooked import HookedJob, run_hooked
from unbroken.detect.levels import LEVEL_LOSS, Level
from unbroken.inject import Injector, parse_fault
from unbroken.jobstore import JobStore
from unbroken.parallel import ActionKind, make_plan
from unbroken.train.phases import Phase

# -- the injector, fake clocks ----------------------------------------------------------------


class PlanRank:
    """Fake time of one plan rank: wall time, and the part of it blocked on peers. A stall
    inside a p2p batch (`after_transfer`) is blocked time, as in the worker."""

    def __init__(self) -> None:
        self.now = 0.0
        self.blocked = 0.0
        self.in_transfer = False
        self.stalls: list[tuple[str, float]] = []

    def wall(self) -> float:
        return self.now

    def busy(self) -> float:
        return self.now - self.blocked

    def sleep(self, s: float) -> None:
        self.stalls.append(("transfer" if self.in_transfer else "hook", s))
        self.now += s
        self.blocked += s if self.in_transfer else 0.0


OWN, WAIT, LINK = 0.2, 1.0, 0.01
# One iteration of a pipeline rank: (hook, own seconds after it) and p2p batches (seconds,
# sent) — two that send and take the link time, one that waits for a neighbour's compute.
ITERATION = [
    ("hook", Phase.FORWARD, 0, 2, OWN),
    ("p2p", LINK, True),
    ("hook", Phase.FORWARD, 1, 2, OWN),
    ("p2p", LINK + WAIT, True),
    ("hook", Phase.BACKWARD, 0, 2, 2 * OWN),
    ("p2p", WAIT, False),
    ("hook", Phase.BACKWARD, 1, 2, 2 * OWN),
    ("hook", Phase.PROTECT, 0, 1, OWN),
    ("hook", Phase.SYNC, 0, 1, OWN),
    ("hook", Phase.UPDATE, 0, 1, OWN),
    ("hook", Phase.BOUNDARY, 0, 1, 0.0),
]
OWN_PER_ITER = sum(s[-1] for s in ITERATION if s[0] == "hook")
PERIOD = OWN_PER_ITER + 2 * LINK + 2 * WAIT


def _drive(spec: str, iterations: int = 6):
    rank, events = PlanRank(), []
    inj = Injector(
        [parse_fault(spec)],
        rank=0,
        store=JobStore(dist.HashStore()),
        emit=lambda kind, **f: events.append((kind, f)),
        job_t0=0.0,
        sleep=rank.sleep,
        clock=rank.wall,
    )
    inj.use_busy_clock(rank.busy)  # what the plan worker does
    per_iter = []
    for it in range(iterations):
        before = len(rank.stalls)
        for step in ITERATION:
            if step[0] == "hook":
                _, phase, k, n, own = step
                inj(phase, it, k, n)
                rank.now += own
            else:
                _, took, sent = step
                rank.now += took
                rank.blocked += took
                rank.in_transfer = True
                inj.after_transfer(it, took, sent)
                rank.in_transfer = False
        per_iter.append(rank.stalls[before:])
    return per_iter, events


def test_compute_stall_on_a_plan_rank_stretches_only_its_own_work():
    per_iter, _ = _drive("slow:rank=0,iter=2,factor=3")
    assert per_iter[:2] == [[], []]
    for stalls in per_iter[3:]:
        # (F - 1) x own work; the waits in p2p batches (2 x WAIT) are not stretched.
        assert sum(s for _, s in stalls) == pytest.approx(2 * OWN_PER_ITER)
        assert {w for w, _ in stalls} == {"hook"}


def test_comm_stall_on_a_plan_rank_follows_each_sending_batch_by_the_link_time():
    per_iter, events = _drive("slow:rank=0,iter=2,factor=5,what=comm")
    assert per_iter[:2] == [[], []]
    for stalls in per_iter[3:]:
        # the link time is the shortest batch (the one that waited is not the link)
        assert stalls == [("transfer", pytest.approx(4 * LINK))] * 2
    active = dict(events)["slow_active"]
    assert (active["what"], active["sends"]) == ("comm", 2)
    assert active["link_s"] == pytest.approx(LINK)
    assert active["comm_s"] == pytest.approx(2 * LINK)
    assert active["comm_share"] == pytest.approx(2 * LINK / PERIOD)


@pytest.mark.parametrize("level", list(Level))
def test_comm_level_on_a_plan_rank_costs_its_throughput_share(level):
    per_iter, _ = _drive(f"slow:rank=0,iter=2,level={level.value},what=comm")
    stall = sum(s for _, s in per_iter[4])
    assert 1 - PERIOD / (PERIOD + stall) == pytest.approx(LEVEL_LOSS[level])


def test_comm_fault_on_a_plan_rank_waits_for_one_complete_iteration_of_transfers():
    per_iter, events = _drive("slow:rank=0,iter=0,factor=3,what=comm", iterations=3)
    assert per_iter[0] == []  # nothing to calibrate on yet
    assert [k for k, _ in events] == ["failure_injected", "slow_active"]
    assert [w for w, _ in per_iter[2]] == ["transfer", "transfer"]


# -- real plan ranks (gloo) -------------------------------------------------------------------


def test_a_compute_slowed_plan_rank_is_not_stretched_by_its_waits(tmp_path):
    # PP2: rank 1 sleeps 0.1 s before each forward, so rank 0 waits ~0.4 s per iteration in
    # its p2p batches. Rank 0's compute fault (F = 2, stalls recorded, not slept) asks for
    # (F - 1) x its own work: its busy time, not its waits.
    plan = make_plan(1, 2, 1, 4, 4, "1f1b")
    job = HookedJob(
        plan, engine_job(microbatches=4), 4, ("slow:rank=0,iter=1,factor=2",), slow_peer={1: 0.1}
    )
    rank0 = run_hooked(job, tmp_path)[0]
    slowed = [t for t in rank0.timings if t["iter"] >= 2]
    stalled = sum(s for it, _, s in rank0.stalls if it >= 2)
    busy = sum(t["busy_s"] for t in slowed)
    compute = sum(c[-1] for t in slowed for c in t["compute"])
    waited = sum(t["p2p_s"] for t in slowed)
    assert waited > 0.6  # the waits were there ...
    # ... and are not in the stall (the iteration boundary's step straddles two iterations)
    assert compute <= stalled <= busy + 0.1, (stalled, busy, waited)


def test_a_compute_slowed_plan_ranks_actions_take_longer_in_its_own_timings(tmp_path):
    # PP2, rank 0 at F = 4 from iteration 2, stalls slept: each F and B action of rank 0 takes
    # about 4x its healthy seconds in the worker's own timings (`StageTiming.compute`, what
    # the fail-slow watch compares replicas by), as a slower device's kernels would. Before
    # `after_compute` the stall ran at the next hook, between actions: the timings showed a
    # slowed rank at full speed and the watch took it for recovered.
    plan = make_plan(1, 2, 1, 4, 4, "1f1b")
    job = HookedJob(
        plan,
        engine_job(microbatches=4),
        4,
        ("slow:rank=0,iter=2,factor=4",),
        real_stalls=True,
    )
    rank0 = run_hooked(job, tmp_path)[0]

    def action_s(it: int) -> float:
        (t,) = [t for t in rank0.timings if t["iter"] == it]
        return sum(c[-1] for c in t["compute"])

    healthy, slowed = action_s(1), action_s(3)
    assert slowed > 2.5 * healthy, (healthy, slowed)


def _sending_batches(actions) -> int:
    n, sends = 0, False
    for a in [*actions, None]:
        if a is not None and a.is_comm:
            sends |= a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
            continue
        n, sends = n + sends, False
    return n


def test_a_comm_slowed_plan_rank_stalls_after_its_sends_and_its_gradient_reduction(tmp_path):
    # DP2 x PP2: rank 0 sends activations to rank 1 and reduces gradients with rank 2.
    plan = make_plan(2, 2, 1, 4, 2, "1f1b")
    job = HookedJob(
        plan,
        engine_job(microbatches=2),
        4,
        ("slow:rank=0,iter=2,factor=21,what=comm",),
        real_stalls=True,
    )
    ranks = run_hooked(job, tmp_path)
    rank0 = ranks[0]
    active = dict(rank0.events)["slow_active"]
    sends = _sending_batches(plan.actions[0])
    assert (active["what"], active["sends"]) == ("comm", sends) and active["link_s"] > 0
    stalls = [(w, s) for it, w, s in rank0.stalls if it == 3]
    transfer = [s for w, s in stalls if w == "transfer"]
    assert transfer == [pytest.approx(20 * active["link_s"])] * sends
    reduce = [s for w, s in stalls if w == "hook"]
    assert len(reduce) == 1 and reduce[0] > 0  # after the one gradient bucket
    # Inside the blocked time of the batches and of REDUCE_GRAD, not the rank's busy time.
    timing = rank0.timings[3]
    assert timing["p2p_s"] >= sum(transfer) and timing["reduce_s"] >= reduce[0]
    assert all(not r.stalls for k, r in ranks.items() if k != 0)
