"""The phase hooks of a plan's rank ([Note: plan hooks] in `unbroken.engine.interpreter`): a
(phase, step) means the same on every rank — its own k-th forward or backward of the
iteration — so a fault's default step is reached on every replica, and each (phase, step)
fires once per iteration, also with virtual stages. Real gloo ranks (`tests.engine.hooked`)."""

from __future__ import annotations

from collections import Counter

from tests.engine.harness import engine_job
from tests.engine.hooked import HookedJob, run_hooked
from unbroken.parallel import make_plan


def _steps(calls, phase: str, iteration: int) -> list[tuple[int, int]]:
    return [(s, n) for p, it, s, n in calls if p == phase and it == iteration]


def test_a_default_step_fault_fires_on_every_rank_of_every_replica(tmp_path):
    # DP2 x PP2, 2 micro-batches per replica: replica 0 computes micro-batches 0-1, replica 1
    # 2-3. With the global id and count as (step, n), the default step n // 2 = 2 was never
    # reached on replica 0's ranks (0 and 1): their fault never fired.
    plan = make_plan(2, 2, 1, 4, 2, "1f1b")
    faults = tuple(f"slow:rank={r},iter=1,phase=backward,factor=1.5" for r in plan.ranks)
    ranks = run_hooked(HookedJob(plan, engine_job(microbatches=2), 2, faults), tmp_path)
    fired = {
        r: [(f["iter"], f["phase"], f["step"]) for k, f in got.events if k == "failure_injected"]
        for r, got in ranks.items()
    }
    assert fired == {r: [(1, "backward", 1)] for r in plan.ranks}
    for r, got in ranks.items():
        for it in range(2):
            for phase in ("forward", "backward"):
                assert _steps(got.calls, phase, it) == [(0, 2), (1, 2)], (r, phase, it)
            # the gradient reduction over the replicas is hooked as in the trainer
            assert _steps(got.calls, "allreduce", it) == [(0, 1)], r
            assert _steps(got.calls, "reduced", it) == [(0, 1)], r


def test_interleaved_stages_fire_each_forward_and_backward_step_once(tmp_path):
    # PP2 with 2 virtual stages per rank: every micro-batch passes through each rank twice.
    # Each compute action is its own step (n = 4 micro-batches x 2 virtual stages), so no
    # (phase, step) — "forward, step 0" above all, where an iteration starts for the
    # injector and the timers — fires twice in one iteration.
    plan = make_plan(1, 2, 1, 4, 4, "interleaved_1f1b", virtual_stages=2)
    faults = tuple(f"slow:rank={r},iter=1,factor=1.5" for r in plan.ranks)
    ranks = run_hooked(HookedJob(plan, engine_job(microbatches=4), 2, faults), tmp_path)
    for r, got in ranks.items():
        repeated = [c for c, n in Counter(got.calls).items() if n > 1]
        assert repeated == [], r
        for it in range(2):
            for phase in ("forward", "backward"):
                assert _steps(got.calls, phase, it) == [(k, 8) for k in range(8)], (r, phase)
        fired = [(f["iter"], f["step"]) for k, f in got.events if k == "failure_injected"]
        assert fired == [(1, 4)], r  # the middle of the rank's 8 forward steps
