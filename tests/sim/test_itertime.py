"""Iteration-time model (Leto App. C.1): pipeline formula, bucket queue, interference."""

from __future__ import annotations

import pytest

from unbroken.errors import UserError
from unbroken.sim.analytic import analytic_inputs
from unbroken.sim.itertime import (
    IterationInputs,
    bucket_exposure,
    iteration_time,
    megatron_bucket_params,
    pipeline_time,
)
from unbroken.sim.presets import load_hardware, load_model


def test_pipeline_formula_counts_the_bubble_divided_by_v():
    # (M + (S-1)/v) * max stage: 8 microbatches, 4 stages, v=2, slowest stage 0.5 s.
    assert pipeline_time(8, (0.3, 0.5, 0.4, 0.2), vpp=2) == pytest.approx((8 + 3 / 2) * 0.5)
    assert pipeline_time(1, (0.7,)) == pytest.approx(0.7)


def test_megatron_bucket_size():
    assert megatron_bucket_params(8) == 40e6
    assert megatron_bucket_params(128) == 128e6


def test_bucket_queue_by_hand():
    # Two equal buckets, W = 1: ready at 0.5 and 1.0. w = 0.4 each.
    # f1 = 0.5 + 0.4 = 0.9; f2 = max(1.0, 0.9) + 0.4 = 1.4 -> E = 0.4.
    exposed, finish = bucket_exposure((0.4, 0.4), (1.0, 1.0), 1.0)
    assert finish == pytest.approx(1.4)
    assert exposed == pytest.approx(0.4)
    # Slow buckets queue behind each other: f1 = 1.5, f2 = 3.0 -> E = 2.0.
    exposed, _ = bucket_exposure((1.0, 1.5), (1.0, 1.0), 1.0)
    assert exposed == pytest.approx(2.0)
    # Fast buckets hide entirely except the last one's transfer after W.
    exposed, _ = bucket_exposure((0.01,) * 10, (1.0,) * 10, 1.0)
    assert exposed == pytest.approx(0.01)


def _inputs(**kw):
    base = dict(
        microbatches=4,
        stage_s=(1.0,),
        backward_window_s=0.6,
        bucket_s=(0.3, 0.3),
        bucket_params=(1.0, 1.0),
        update_s=0.1,
    )
    base.update(kw)
    return IterationInputs(**base)


def test_overlap_off_charges_the_serial_sync():
    b = iteration_time(_inputs(overlap=False))
    assert b.sync_s == pytest.approx(0.6)
    assert b.iter_s == pytest.approx(4.0 + 0.6 + 0.1)


def test_dense_interference_charges_c_times_hidden_communication():
    b0 = iteration_time(_inputs(interference_dense=0.0))
    b1 = iteration_time(_inputs(interference_dense=0.5))
    hidden = b0.sync_serial_s - b0.exposed_s
    assert b1.sync_s == pytest.approx(b0.exposed_s + 0.5 * hidden)


def test_moe_interference_lies_between_max_and_series():
    # Two flows on one bottleneck cost between max(G, A) and G + A more than compute alone;
    # with f in [0, 1] the charged sync stays within [E(W), E(W) + min(G, A)].
    for f in (0.0, 0.3, 1.0):
        b = iteration_time(_inputs(moe_a2a_s=0.25, interference_moe=f))
        e0, _ = bucket_exposure((0.3, 0.3), (1.0, 1.0), 0.6)
        assert e0 - 1e-12 <= b.sync_s <= e0 + 0.25 + 1e-12


def test_inputs_are_validated():
    with pytest.raises(UserError):
        _inputs(bucket_params=(1.0,))
    with pytest.raises(UserError):
        _inputs(stage_s=())


def test_analytic_iteration_grows_with_microbatches_and_shrinks_with_faster_gpus():
    model, par = load_model("deepseek-v3")
    a100, h100 = load_hardware("a100-p4d"), load_hardware("h100")
    t_a = iteration_time(analytic_inputs(a100, model, par)).iter_s
    t_h = iteration_time(analytic_inputs(h100, model, par)).iter_s
    assert t_h < t_a
    _, bigger = load_model("deepseek-v3", {"global_batch": 2 * par.global_batch})
    t_2 = iteration_time(analytic_inputs(a100, model, bigger)).iter_s
    assert 1.6 * t_a < t_2 < 2.05 * t_a


def test_inter_node_moe_all_to_all_is_flagged_for_interference():
    hw = load_hardware("a100-p4d")
    model, par = load_model("deepseek-v3")  # EP 64 spans 8 nodes
    assert analytic_inputs(hw, model, par).moe_a2a_s > 0
    model, par = load_model("olmoe")  # EP 4 within a node
    assert analytic_inputs(load_hardware("a100"), model, par).moe_a2a_s == 0
