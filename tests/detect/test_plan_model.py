"""The fail-slow model of a hybrid-parallel plan on synthetic timings (no processes): the
predicted iteration is the plan's dry-run simulation with every F/B/W chunk priced from its
micro-batch's documents, and validation names the slow rank and its stage, also inside a TP
group whose peers wait for it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from unbroken.detect import (
    DetectorConfig,
    FailSlowDetector,
    Observation,
    StageTiming,
    Verdict,
    fit_plan,
)
from unbroken.parallel import ActionKind, Costs, ParallelPlan, make_plan, simulate

from .synth import mb_time, split

LINK = 2e-4
KIND = {"F": 1 / 3, "B": 1 / 3, "W": 1 / 3}
HEAD = 0.05
"""Extra share of the last stage's forward (head and loss), which layer counts do not see."""


def _share(plan: ParallelPlan, stage: int, kind: str) -> float:
    lo, hi = plan.replicas[0].stages[stage].layers
    extra = HEAD if stage == plan.num_stages - 1 and kind == "F" else 0.0
    return (hi - lo) / plan.num_layers * KIND[kind] + extra


def _true_costs(plan: ParallelPlan, t_mb: dict[int, float], slowdown: dict[int, float]) -> Costs:
    return Costs(
        compute=lambda w: _share(plan, w.stage, w.kind.value) * t_mb[w.microbatch],
        link=LINK,
        slowdown=slowdown,
    )


def plan_series(
    plan: ParallelPlan,
    iterations: int,
    *,
    seed: int = 0,
    noise: float = 0.01,
    pieces=None,
    slow_rank: int | None = None,
    slow_iter: int = 10**9,
    slow_until: int = 10**9,
    factor: float = 1.0,
    overhead_s: float = 0.01,
) -> tuple[list[Observation], list[float]]:
    """Iterations of `plan` whose chunks cost their share of alpha N + beta sum l^2, with
    `slow_rank` `factor` x slower from `slow_iter` until `slow_until`; returns the observations and each
    iteration's time without noise. Each rank's busy time is its own compute (a TP peer of the
    slow rank runs at its pace, but the difference is waiting in the TP collectives)."""
    rng = np.random.default_rng(seed)
    out, truth = [], []
    for it in range(iterations):
        docs = [
            [split(rng, pieces(it) if pieces else int(rng.choice([1, 1, 1, 2, 4]))) for _ in ids]
            for ids in (plan.microbatch_ids(d) for d in range(plan.dp))
        ]
        t_mb = {
            mb: mb_time(docs[d][i])
            for d in range(plan.dp)
            for i, mb in enumerate(plan.microbatch_ids(d))
        }
        slow = slow_rank is not None and slow_iter <= it < slow_until
        slowdown = {slow_rank: factor} if slow else {}
        costs = _true_costs(plan, t_mb, slowdown)
        exact = simulate(plan, costs, check_blocking=False).iteration_time + overhead_s
        truth.append(exact)
        stages = {}
        for rank, acts in plan.actions.items():
            d, s = plan.locate(rank)
            group = costs.slowness(plan.replicas[d].stages[s].ranks)
            split_b = {(a.stage, a.microbatch) for a in acts if a.kind is ActionKind.W}
            compute, own = [], 0.0
            for a in acts:
                if not a.is_compute:
                    continue
                share = _share(plan, a.stage, a.kind.value)
                if a.kind is ActionKind.B and (a.stage, a.microbatch) not in split_b:
                    share += _share(plan, a.stage, "W")
                base = share * t_mb[a.microbatch] * (1 + noise * rng.standard_normal())
                compute.append((a.kind.value, a.stage, a.microbatch, base * group))
                own += base * slowdown.get(rank, 1.0)
            stages[rank] = StageTiming(
                rank=rank,
                iteration=it,
                compute=tuple(compute),
                busy_s=own + 0.001,
                p2p_min_s=LINK,
                step_s=0.002,
            )
        seconds = exact * (1 + noise * rng.standard_normal())
        out.append(Observation(iteration=it, seconds=seconds, doc_lengths=docs, stages=stages))
    return out, truth


PLANS = {
    "tp2xpp2-1f1b": lambda: make_plan(1, 2, 2, 4, 4, "1f1b"),
    "dp2xpp2-zb_h1": lambda: make_plan(2, 2, 1, 4, 4, "zb_h1"),
    "pp2-interleaved": lambda: make_plan(1, 2, 1, 4, 4, "interleaved_1f1b", virtual_stages=2),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_prediction_is_the_plans_schedule_priced_per_microbatch(name):
    plan = PLANS[name]()
    obs, truth = plan_series(plan, 30, seed=1)
    fit = fit_plan(plan, [(o.doc_lengths, o.seconds, o.stages) for o in obs[:10]])
    # Each chunk is priced at its layer share times the F/B/W split (a backward without W is
    # the full one), plus the head on the last stage: measured, not assumed.
    fused_b = not any(a.kind is ActionKind.W for acts in plan.actions.values() for a in acts)
    docs = (1500, 548)
    for (d, k, kind), share in fit.schedule.shares.items():
        assert d in range(plan.dp)
        want = _share(plan, k, kind) + (_share(plan, k, "W") if kind == "B" and fused_b else 0)
        got = share * fit.predictor.mb.predict(docs)
        assert got == pytest.approx(want * mb_time(docs), rel=0.03), (k, kind)
    errors = [
        abs(fit.predictor.iteration_time(o.doc_lengths) - t) / t
        for o, t in zip(obs[10:], truth[10:], strict=True)
    ]
    assert max(errors) < 0.03, errors
    # Workload-aware: the same plan with every micro-batch one document is predicted slower,
    # by what the simulator says the pipeline makes of it (not by the sum of the chunks).
    one_doc = [[[2048] for _ in plan.microbatch_ids(d)] for d in range(plan.dp)]
    t_one = {mb: mb_time((2048,)) for mb in range(plan.total_microbatches)}
    expected = simulate(plan, _true_costs(plan, t_one, {}), check_blocking=False)
    assert fit.predictor.iteration_time(one_doc) == pytest.approx(
        expected.iteration_time + 0.01, rel=0.03
    )


@pytest.mark.parametrize(("rank", "stage"), [(3, 1), (0, 0)])
def test_a_slow_rank_inside_a_tp_group_is_named_with_its_stage(rank, stage):
    plan = make_plan(1, 2, 2, 4, 4, "1f1b")  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    obs, _ = plan_series(plan, 45, seed=rank, slow_rank=rank, slow_iter=30, factor=2.0)
    det = FailSlowDetector(DetectorConfig(), plan=plan)
    decisions = [det.observe(o) for o in obs]
    reports = [d.report for d in decisions if d.report]
    assert [(r.rank, r.stage) for r in reports] == [(rank, stage)]
    assert 30 <= reports[0].detected_at <= 33
    assert reports[0].factor == pytest.approx(2.0, rel=0.15)
    assert not [d for d in decisions if d.verdict is Verdict.FALSE_ALARM]


def _blocks(it: int) -> int:
    # Cheap multi-document micro-batches, and after warm-up every 12 iterations a run of 3 with
    # expensive single-document ones: the iteration time jumps up for several iterations.
    return 1 if it >= 20 and it % 12 < 3 else 6


def test_plan_workload_swings_are_benign():
    plan = make_plan(1, 2, 2, 4, 4, "1f1b")
    obs, _ = plan_series(plan, 70, seed=7, pieces=_blocks)
    det = FailSlowDetector(DetectorConfig(), plan=plan)
    verdicts = [det.observe(o).verdict for o in obs]
    # Ours watches time over the plan's predicted time, which these swings do not move.
    assert Verdict.FAIL_SLOW not in verdicts and Verdict.FALSE_ALARM not in verdicts
    # Without the workload filter the same swings are validated (and found to be no rank).
    base = FailSlowDetector(DetectorConfig(baseline=True), plan=plan)
    assert Verdict.FALSE_ALARM in [base.observe(o).verdict for o in obs]


def test_stage_timing_round_trips_through_its_record():
    t = StageTiming(
        rank=2,
        iteration=5,
        compute=(("F", 1, 0, 0.5), ("B", 1, 0, 1.0)),
        busy_s=1.25,
        p2p_s=0.5,
        p2p_min_s=0.1,
        tp_s=0.25,
        reduce_s=0.125,
        sync_s=0.0625,
        step_s=0.03125,
        probe=(("F", 1, 0, 0.75), ("B", 1, 0, 1.5)),
    )
    assert StageTiming.from_dict(t.to_dict()) == t


def _watch(det: FailSlowDetector, obs: list[Observation]) -> tuple[list, list]:
    """Feed `obs`; (reported (rank, detected_at), recovered (rank, first, last)) in order."""
    reports, back = [], []
    for o in obs:
        d = det.observe(o)
        if d.report is not None:
            reports.append((d.report.rank, d.report.detected_at))
        back += [(r.report.rank, r.first, r.last) for r in det.take_recovered()]
    return reports, back


def _watch_carried(
    plan: ParallelPlan, first: FailSlowDetector, obs: list[Observation]
) -> tuple[list, list]:
    """`_watch` of a fresh detector on `plan` that carries `first`'s open reports (the
    coordinator's live switch, `carry_reports`)."""
    det = FailSlowDetector(DetectorConfig(), plan=plan)
    det.carry_reports(first)
    return _watch(det, obs)


def test_a_plan_rank_back_at_its_stage_peers_pace_is_recovered():
    # PP2 x DP2: rank 0 (replica 0, stage 0) 3x slower for iterations 14..27. Its stage's
    # holder in replica 1 (rank 2) is the peer it is compared with.
    plan = make_plan(2, 2, 1, 4, 4, "1f1b")
    obs, _ = plan_series(plan, 44, seed=3, slow_rank=0, slow_iter=14, slow_until=28, factor=3)
    reports, back = _watch(FailSlowDetector(DetectorConfig(), plan=plan), obs)
    assert [r for r, _ in reports] == [0]
    ((rank, first, last),) = back
    # Read as the window's median iteration (`LayerPace`): found once most of the window runs
    # at full speed again (from 28), not before.
    window = DetectorConfig().recover_window
    assert rank == 0 and last - first == window - 1 and last - 28 + 1 > window // 2
    # A rank that stays slow is never found back.
    obs, _ = plan_series(plan, 44, seed=3, slow_rank=0, slow_iter=14, factor=3)
    reports, back = _watch(FailSlowDetector(DetectorConfig(), plan=plan), obs)
    assert [r for r, _ in reports] == [0] and back == []


def test_a_detector_restarted_on_a_live_plan_keeps_watching_the_slow_rank():
    # The coordinator's live switch: a fresh detector warms up on the new plan (rank 0 still
    # slow, its replica left one micro-batch) and carries the open report over
    # (`carry_reports`): the slowness it fitted is not news, and the return to speed is found.
    launch = make_plan(2, 2, 1, 4, 4, "1f1b")
    first = FailSlowDetector(DetectorConfig(), plan=launch)
    obs, _ = plan_series(launch, 20, seed=4, slow_rank=0, slow_iter=14, factor=3)
    assert [r for r, _ in _watch(first, obs)[0]] == [0]
    moved = make_plan(2, 2, 1, 4, [1, 7], "1f1b")
    obs, _ = plan_series(moved, 44, seed=5, slow_rank=0, slow_iter=0, slow_until=24, factor=3)
    reports, back = _watch_carried(moved, first, obs)
    assert reports == []  # the carried report is known
    ((rank, first_back, _),) = back
    assert rank == 0 and first_back >= 24
    # Without the carried report nothing is watched: the warm-up learned the slow rank (no
    # rank is on trial: `suspects`).
    fresh = FailSlowDetector(DetectorConfig(), plan=moved)
    assert _watch(fresh, obs) == ([], [])


def test_a_plan_rank_on_trial_slow_through_the_warm_up_is_reported_at_its_end():
    # A device re-admitted on trial while still slow shows no change point: PP2 x DP2, rank 3
    # (on trial: `suspects`) 3x slower from iteration 0 is reported at the end of the warm-up,
    # against rank 1 (its stage in the other replica), with about its factor. The same series
    # without the slowdown reports nothing; a rank not on trial is not checked so (a launch's
    # warm-up: two ranks' paces are too noisy to report on alone); a one-replica pipeline has
    # no peers.
    cfg = DetectorConfig()
    plan = make_plan(2, 2, 1, 4, 4, "1f1b")
    obs, _ = plan_series(plan, 20, seed=7, slow_rank=3, slow_iter=0, factor=3)
    det = FailSlowDetector(cfg, plan=plan, suspects=frozenset({3}))
    reports, _ = _watch(det, obs)
    assert reports == [(3, cfg.skip_iters + cfg.warmup_iters - 1)]
    assert det.reported[(3, "compute")].factor == pytest.approx(3, rel=0.2)
    assert _watch(FailSlowDetector(cfg, plan=plan), obs)[0] == []
    healthy, _ = plan_series(plan, 20, seed=7)
    assert _watch(FailSlowDetector(cfg, plan=plan, suspects=frozenset({3})), healthy)[0] == []
    one = make_plan(1, 2, 1, 4, 4, "1f1b")
    obs, _ = plan_series(one, 20, seed=7, slow_rank=1, slow_iter=0, factor=3)
    assert _watch(FailSlowDetector(cfg, plan=one, suspects=frozenset({1})), obs)[0] == []


def test_a_one_replica_pipeline_rank_slow_through_its_warm_up_is_held_to_its_pace_before():
    # A lost device dissolved the other replica and this stage slowed down before the new
    # world's detector warmed up: no change point, no peer. Its pace per layer in the world
    # before (`layer_paces`, carried as `references`) is the reference: rank 1 3x slow from
    # iteration 0 is reported at the warm-up's end with about its factor, and held to that
    # pace for its return. Without references, or healthy, nothing is reported.
    cfg = DetectorConfig()
    plan = make_plan(1, 2, 1, 4, 4, "1f1b")
    before = FailSlowDetector(cfg, plan=plan)
    healthy, _ = plan_series(plan, 20, seed=7)
    assert _watch(before, healthy) == ([], [])
    refs = before.layer_paces()
    assert set(refs) == {0, 1} and all(r.layers == 2 for r in refs.values())
    obs, _ = plan_series(plan, 20, seed=8, slow_rank=1, slow_iter=0, factor=3)
    det = FailSlowDetector(cfg, plan=plan, references=refs)
    assert _watch(det, obs)[0] == [(1, cfg.skip_iters + cfg.warmup_iters - 1)]
    assert det.reported[(1, "compute")].factor == pytest.approx(3, rel=0.2)
    assert det.healthy[1] is refs[1]
    assert _watch(FailSlowDetector(cfg, plan=plan), obs)[0] == []
    again, _ = plan_series(plan, 20, seed=9)
    assert _watch(FailSlowDetector(cfg, plan=plan, references=refs), again)[0] == []


def test_a_one_replica_pipeline_rank_is_found_back_at_its_own_healthy_pace():
    # PP2, one replica: rank 0 has no other holder of its stage to be compared with, so it is
    # held to its own compute per layer before the slowdown (`LayerPace`).
    plan = make_plan(1, 2, 1, 4, 4, "1f1b")
    obs, _ = plan_series(plan, 44, seed=3, slow_rank=0, slow_iter=14, slow_until=28, factor=3)
    det = FailSlowDetector(DetectorConfig(), plan=plan)
    reports, back = _watch(det, obs)
    assert [r for r, _ in reports] == [0] and det.healthy == {}  # forgotten once back
    ((rank, first, last),) = back
    # Read as the window's median iteration (`LayerPace`): found once most of the window runs
    # at full speed again (from 28), not before.
    window = DetectorConfig().recover_window
    assert rank == 0 and last - first == window - 1 and last - 28 + 1 > window // 2
    # A rank that stays slow is never found back.
    obs, _ = plan_series(plan, 44, seed=3, slow_rank=0, slow_iter=14, factor=3)
    det = FailSlowDetector(DetectorConfig(), plan=plan)
    reports, back = _watch(det, obs)
    assert [r for r, _ in reports] == [0] and back == [] and 0 in det.healthy


def test_a_one_replica_pipeline_rank_whose_layers_moved_is_found_back_per_layer():
    # The re-plan moved a layer off slow rank 0 ([0, 2) [2, 4) -> [0, 1) [1, 4)); a fresh
    # detector on the new plan carries the report and rank 0's healthy pace per layer: its
    # warm-up only saw rank 0 slow, and from the first iteration past the skipped ones rank 0
    # is measured per layer against the pace before the slowdown, so it is found back once at
    # full speed (the last stage also holds the head: its pace per layer is not rank 0's).
    launch = make_plan(1, 2, 1, 4, 4, "1f1b")
    first = FailSlowDetector(DetectorConfig(), plan=launch)
    obs, _ = plan_series(launch, 20, seed=4, slow_rank=0, slow_iter=14, factor=3)
    assert [r for r, _ in _watch(first, obs)[0]] == [0] and 0 in first.healthy
    moved = make_plan(1, 2, 1, 4, 4, "1f1b", layer_split=[1, 3])
    obs, _ = plan_series(moved, 44, seed=5, slow_rank=0, slow_iter=0, slow_until=24, factor=3)
    reports, back = _watch_carried(moved, first, obs)
    assert reports == []  # the carried report is known
    ((rank, first_back, last),) = back
    window = DetectorConfig().recover_window
    assert rank == 0 and last - first_back == window - 1 and last - 24 + 1 > window // 2
    # Still slow on the moved plan: not found back (3x per layer, not 1x).
    obs, _ = plan_series(moved, 44, seed=5, slow_rank=0, slow_iter=0, factor=3)
    assert _watch_carried(moved, first, obs) == ([], [])
    healthy = first.healthy[0]
    ratio = healthy.ratio(moved, [(o.doc_lengths, o.stages) for o in obs[20:28]], 0)
    assert ratio == pytest.approx(3.0, rel=0.05)


def _with_probes(
    plan: ParallelPlan, obs: list[Observation], every: int, slow: dict[int, float], until: int
) -> list[Observation]:
    """`obs` with the empty replica's ranks timing a probe of micro-batch 0 every `every`-th
    iteration ([Note: probe micro-batch] in `unbroken.engine.probe`), rank r `slow[r]` x slower
    before iteration `until`."""
    out = []
    for o in obs:
        stages = dict(o.stages or {})
        if o.iteration % every == 0:
            t_mb = mb_time(o.doc_lengths[0][0])
            for rank in probe_ranks(plan):
                _, s = plan.locate(rank)
                f = slow.get(rank, 1.0) if o.iteration < until else 1.0
                probe = tuple((k, s, 0, _share(plan, s, k) * t_mb * f) for k in ("F", "B"))
                stages[rank] = dataclasses.replace(stages[rank], probe=probe)
        out.append(dataclasses.replace(o, stages=stages))
    return out


def probe_ranks(plan: ParallelPlan) -> list[int]:
    return [r for r in plan.ranks if plan.microbatches[plan.locate(r)[0]] == 0]


def test_an_empty_replicas_rank_is_recovered_from_its_probes_and_only_from_them():
    # Rank 2 (replica 1, stage 0) reported 3x slow; the live re-plan emptied replica 1
    # ([8, 0]). Its ranks compute nothing; a probe every 2 iterations times rank 2 against
    # rank 0 (stage 0 of replica 0). Healthy again from iteration 24: found back over a window
    # after its last slow probe (iteration 22).
    launch = make_plan(2, 2, 1, 4, 4, "1f1b")
    first = FailSlowDetector(DetectorConfig(), plan=launch)
    obs, _ = plan_series(launch, 20, seed=4, slow_rank=2, slow_iter=14, factor=3)
    assert [r for r, _ in _watch(first, obs)[0]] == [2]
    empty = make_plan(2, 2, 1, 4, [8, 0], "1f1b")
    assert probe_ranks(empty) == [2, 3]
    plain, _ = plan_series(empty, 44, seed=5)
    healed = _with_probes(empty, plain, 2, {2: 3.0}, until=24)
    reports, back = _watch_carried(empty, first, healed)
    ((rank, first_back, _),) = back
    assert reports == [] and rank == 2 and first_back > 22
    # Still slow in its probes: not recovered; no probes at all: no pace, not recovered.
    still_slow = _with_probes(empty, plain, 2, {2: 3.0}, until=10**9)
    assert _watch_carried(empty, first, still_slow) == ([], [])
    assert _watch_carried(empty, first, plain) == ([], [])
