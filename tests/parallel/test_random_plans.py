"""Random layouts, schedules and migrations: every generated plan is coherent and completes."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel import Costs, Migration, ParallelPlan, check_plan, make_plan, simulate


@st.composite
def plans(draw: st.DrawFn) -> ParallelPlan:
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]))
    dp = draw(st.integers(1, 2))
    pp = draw(st.integers(1, 4))
    v = draw(st.integers(2, 3)) if schedule == "interleaved_1f1b" else 1
    tp = [[draw(st.sampled_from([1, 2, 4])) for _ in range(pp)] for _ in range(dp)]
    if v > 1:
        counts = [pp * draw(st.integers(1, 2)) for _ in range(dp)]
    else:
        counts = [draw(st.integers(0 if dp > 1 else 1, 5)) for _ in range(dp)]
        if sum(counts) == 0:
            counts[0] = 1
    moves = []
    if v == 1 and dp > 1:
        rng = random.Random(draw(st.integers(0, 2**16)))
        for mb in range(sum(counts)):
            for stage in range(pp):
                if rng.random() < 0.3:
                    owner = 0 if mb < counts[0] else 1
                    moves.append(Migration(mb, stage, 1 - owner))
    return make_plan(
        dp=dp,
        pp=pp,
        tp=tp,
        num_layers=pp * v * 2,
        microbatches=counts,
        schedule=schedule,
        virtual_stages=v,
        migrations=moves,
    )


@settings(max_examples=60, deadline=None)
@given(plan=plans(), seed=st.integers(0, 1000))
def test_generated_plans_are_coherent_and_complete(plan: ParallelPlan, seed: int) -> None:
    assert check_plan(plan) == []
    assert ParallelPlan.from_json(plan.to_json()) == plan
    rng = random.Random(seed)
    speed = {r: rng.choice([1.0, 1.0, 1.5]) for r in plan.ranks}
    costs = Costs(
        compute=lambda w: {"F": 1.0, "B": 2.0, "W": 0.5}[w.kind] * (1 + w.microbatch % 3),
        link=rng.choice([0.0, 0.3]),
        slowdown=speed,
    )
    for sends in ("eager", "rendezvous"):
        timeline = simulate(plan, costs, sends=sends)
        assert timeline.ok, [str(p) for p in timeline.deadlocks[:3]]
        # Every compute is timed once and no rank is busier than the iteration.
        assert len(timeline.actions) == sum(len(a) for a in plan.actions.values())
        assert all(b <= timeline.iteration_time + 1e-9 for b in timeline.busy.values())
        assert timeline.critical_path[-1].end == timeline.iteration_time
