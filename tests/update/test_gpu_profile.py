"""The reduction `bench gpu --profile-step` applies to a profiler trace (no device needed)."""

from __future__ import annotations

from unbroken.bench.gpu_profile import _busy_and_gaps, _family, _host_op_at


def test_busy_time_is_the_union_of_the_kernel_intervals_and_long_gaps_are_listed():
    # Overlapping kernels (two streams) count once; the 400 us gap is listed, the 50 us is not.
    kernels = [(0.0, 100.0), (50.0, 150.0), (200.0, 300.0), (700.0, 800.0)]
    busy, gaps = _busy_and_gaps(kernels, gap_us=100.0)
    assert busy == 150.0 + 100.0 + 100.0
    assert gaps == [(300.0, 400.0)]
    assert _busy_and_gaps([], 1.0) == (0.0, [])


def test_a_gap_is_named_by_the_innermost_host_op_running_when_it_began():
    ops = [(0.0, 1000.0, "aten::linear"), (290.0, 320.0, "aten::mm"), (500.0, 600.0, "x")]
    assert _host_op_at(ops, 300.0) == "aten::mm"
    assert _host_op_at(ops, 400.0) == "aten::linear"
    assert _host_op_at(ops, 2000.0) == "?"


def test_kernel_families():
    assert _family("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert _family("triton_tem_fused_flex_attention_backward_5") == "attention"
    assert _family("Memcpy DtoD (Device -> Device)") == "memcpy_memset"
    assert _family("triton_poi_fused_mul_silu_9") == "other"
