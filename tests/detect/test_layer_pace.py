"""`LayerPace` under a fixed cost per action: a one-replica pipeline's rank whose layers moved is
found back at full speed and still slow when slow, where the proportional model (every second
scales with layers) read a rank back at full speed with one layer as 1.33x slow."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.detect.layer_pace import MIN_CHANGE, LayerPace, Work, fixed_cost
from unbroken.detect.timing import StageTiming
from unbroken.detect.workload import MicroBatchModel
from unbroken.parallel import make_plan

MB = MicroBatchModel(alpha=1e-4, beta=0.0)
FIXED_S = 0.002  # per action, whatever the layers ...
LAYER_S = 0.002  # ... and per layer (at T_MB = 2 ms): the fixed cost is one layer's worth


def _window(plan, iterations: int, speed: dict[int, float], seed: int = 0):
    """Iterations of `plan`, 4 micro-batches of 20 tokens; an action of rank r takes
    (FIXED_S + layers x LAYER_S x T_MB / 2 ms) x speed[r] with 1 % noise."""
    rng = np.random.default_rng(seed)
    out = []
    for it in range(iterations):
        lengths = [[(20,) for _ in plan.microbatch_ids(0)]]
        stages = {}
        for rank, acts in plan.actions.items():
            _, s = plan.locate(rank)
            lo, hi = plan.replicas[0].stages[s].layers
            compute = []
            for a in acts:
                if not a.is_compute:
                    continue
                t_mb = MB.predict(lengths[0][0])
                took = FIXED_S + (hi - lo) * LAYER_S * t_mb / 2e-3
                took *= speed.get(rank, 1.0) * (1 + 0.01 * rng.standard_normal())
                compute.append((a.kind.value, a.stage, a.microbatch, took))
            stages[rank] = StageTiming(
                rank=rank, iteration=it, compute=tuple(compute), busy_s=sum(c[3] for c in compute)
            )
        out.append((lengths, stages))
    return out


LAUNCH = make_plan(1, 2, 1, 4, 4, "1f1b")  # [0, 2) [2, 4)
MOVED = make_plan(1, 2, 1, 4, 4, "1f1b", layer_split=[1, 3])  # [0, 1) [1, 4)


def test_the_fixed_cost_is_solved_from_a_healthy_rank_whose_layers_changed():
    before = Work.of(LAUNCH, MB, _window(LAUNCH, 8, {}), 1)
    now = Work.of(MOVED, MB, _window(MOVED, 8, {0: 4.0}, seed=1), 1)
    assert fixed_cost(before, now) == pytest.approx(FIXED_S, rel=0.1)
    # Unchanged layers: two equations that are one; nothing is estimated.
    again = Work.of(LAUNCH, MB, _window(LAUNCH, 8, {}, seed=2), 1)
    assert abs(again.per_action / before.per_action - 1) < MIN_CHANGE
    assert fixed_cost(before, again) is None


def test_a_rank_left_with_one_layer_is_found_back_at_full_speed_and_not_while_slow():
    pace = LayerPace.measure(LAUNCH, MB, _window(LAUNCH, 8, {}), 0)
    assert pace is not None
    back = _window(MOVED, 8, {}, seed=3)
    assert pace.ratio(MOVED, back, 0) == pytest.approx(1.0, abs=0.05)
    still = _window(MOVED, 8, {0: 4.0}, seed=4)
    assert pace.ratio(MOVED, still, 0) == pytest.approx(4.0, rel=0.05)
    # The proportional model (no reference: c = 0) reads the rank at full speed as slow:
    # (2 + 1) / 2 per layer before, (2 + 2) / 1 now -> 1.33x, above recover_ratio 1.1.
    alone = LayerPace(mb=pace.mb, own=pace.own, others={})
    assert alone.ratio(MOVED, back, 0) == pytest.approx(4 / 3, rel=0.05)


def test_a_rank_reported_slow_is_no_reference():
    pace = LayerPace.measure(LAUNCH, MB, _window(LAUNCH, 8, {}), 0)
    back = _window(MOVED, 8, {}, seed=5)
    assert pace.ratio(MOVED, back, 0, exclude={1}) == pytest.approx(4 / 3, rel=0.05)
