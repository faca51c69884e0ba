"""A one-rank plan in this process keeps the trainer's contract: same phase hooks in the same
order, same bits, and the updater the caller chose."""

from __future__ import annotations

import torch

from tests.engine.harness import engine_job, one_thread
from tests.foundation.conftest import local_trainer
from unbroken.engine.build import build_worker
from unbroken.parallel import make_plan
from unbroken.update import PlainUpdater


def test_one_rank_plan_is_the_trainer(world):
    cfg = engine_job(grad_clip=0.0)
    seen_ref, seen_ours, made = [], [], []

    def record(into):
        return lambda phase, it, step, n: into.append((str(phase), it, step, n))

    def make_updater(state, geometry, step):
        made.append(state)
        return PlainUpdater(state, geometry, step)

    with one_thread():
        built, ref = local_trainer(cfg, hooks=[record(seen_ref)])
        plan = make_plan(1, 1, 1, 4, cfg.data.microbatches, "1f1b")
        ours = build_worker(
            cfg,
            plan,
            world,
            device=torch.device("cpu"),
            hooks=[record(seen_ours)],
            make_updater=make_updater,
        )
        for it in range(3):
            a, b = ref.run_iteration(it), ours.worker.run_iteration(it)
            assert a.loss == b.loss
            # The workload (fail-slow detection): the same micro-batches, named by global id.
            assert b.doc_lengths == a.doc_lengths
            assert b.microbatches == tuple(range(cfg.data.microbatches))
            timing = ours.worker.timing
            assert timing.iteration == it
            assert [(k, m) for k, _, m, _ in timing.compute] == [
                (str(x.kind), x.microbatch) for x in plan.actions[0] if x.is_compute
            ]
            assert 0 < sum(s for *_, s in timing.compute) < timing.busy_s <= b.seconds
            assert timing.p2p_s == timing.tp_s == 0.0
    assert made == [ours.state]
    assert seen_ours == seen_ref
    assert {p for p, *_ in seen_ours} >= {"forward", "backward", "protect", "sync", "update"}
    ref_params = built.state.layout.views(built.state.params)
    for name, view in ours.state.layout.views(ours.state.params).items():
        assert torch.equal(view, ref_params[name]), name
