"""The planner's input: typed, validated, built from detector reports, JSON round trip."""

from __future__ import annotations

import json

import pytest

from tests.plan.helpers import layout, state
from unbroken.detect.events import DetectionEvent, DetectionKind
from unbroken.plan import ClusterState, Device, DeviceStatus, Workload
from unbroken.sim.presets import load_hardware
from unbroken.sim.workload import ModelConfig


def test_detector_reports_become_device_states():
    cluster = state(layout(1, 2, 2, 4))
    slow = cluster.apply(
        DetectionEvent(kind=DetectionKind.FAIL_SLOW, rank=1, factor=2.5, cause="compute")
    )
    assert slow.device(1).status is DeviceStatus.SLOW and slow.device(1).speed == 0.4
    comm = slow.apply(DetectionEvent(kind=DetectionKind.FAIL_SLOW, rank=2, factor=4, cause="comm"))
    assert comm.device(2).link_speed == 0.25 and comm.device(2).speed == 1
    lost = comm.apply(DetectionEvent(kind=DetectionKind.FAIL_STOP, rank=3))
    assert lost.lost == {3}
    assert cluster.lost == frozenset()  # states are values
    with pytest.raises(ValueError, match="localized"):
        cluster.apply(DetectionEvent(kind=DetectionKind.FAIL_STOP, rank=None))


def test_invalid_devices_and_states_are_refused():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        Device(rank=0, node=0, memory_bytes=1e9, status="slow", speed=1.5)
    with pytest.raises(ValueError, match="healthy"):
        Device(rank=0, node=0, memory_bytes=1e9, speed=0.5)
    cluster = state(layout(1, 2, 1, 2))
    with pytest.raises(ValueError, match="no device"):
        ClusterState(
            devices=cluster.devices[:1],
            plan=cluster.plan,
            workload=cluster.workload,
            fabric=cluster.fabric,
        )


def test_standbys_are_live_devices_outside_the_plan():
    cluster = state(layout(1, 2, 1, 2), spare=2).with_lost(3)
    assert cluster.standbys == (2,)


def test_a_state_round_trips_through_json():
    cluster = state(layout(2, 2, 2, 4)).with_slow(1, speed=0.5).with_lost(6)
    again = ClusterState.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert again == cluster


def test_the_workload_model_prices_layers_from_flops():
    hw = load_hardware("a100")
    model = ModelConfig(
        name="m",
        total_params=6.74e9,
        active_params=6.74e9,
        layers=32,
        hidden=4096,
        vocab=32000,
        attn_dim=8192,
        seq_len=4096,
    )
    wl = Workload.from_model(model, hw)
    rate = hw.peak_flops * hw.compute_efficiency
    layer_params = (6.74e9 - 2 * 32000 * 4096) / 32
    assert wl.layer_s() == pytest.approx((2 * layer_params * 4096 + 8192 * 4096**2) / rate)
    packed = Workload.from_model(model, hw, sum_sq=4 * 1024**2)  # four 1k documents
    assert packed.layer_s() < wl.layer_s()  # block-diagonal attention is cheaper
    f1, b1 = wl.stage_compute_s((0, 16), 1, load_fabric(hw))
    f4, _ = wl.stage_compute_s((0, 16), 4, load_fabric(hw))
    assert f4 < f1 / 3 and b1 == pytest.approx(2 * (f1 - wl.embed_s))
    assert wl.device_bytes((0, 16), 4, 2) < wl.device_bytes((0, 16), 2, 2)
    assert wl.calibrated(0.01).layer_s() == pytest.approx(0.01)


def load_fabric(hw):
    from unbroken.plan import Fabric

    return Fabric.from_hardware(hw)
