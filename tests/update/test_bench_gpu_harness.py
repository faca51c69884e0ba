"""`unbroken bench gpu`'s harness, run on the CPU (`--device cpu` smoke-tests it; the figures
are for the H200 only): one run prints every headline key with a value, the resumable update
and the checkpoint round trip included. Slow tier (about 20 s): a benchmark's harness."""

from __future__ import annotations

import json

import pytest

from unbroken.cli.main import main


@pytest.mark.slow
def test_the_harness_runs_end_to_end_on_the_cpu(capsys, tmp_path):
    rc = main(
        [
            "bench", "gpu", "--device", "cpu", "--preset", "small", "--tokens", "128",
            "--microbatches", "2", "--iterations", "2", "--kernels", "flex",
            "--tokenizer", "bytes", "--ckpt-dir", str(tmp_path / "ckpt"), "--json",
        ]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "mfu",
        "plain_update_ms",
        "rmu_update_ms",
        "overhead_pct",
        "overhead_pct_phases",
        "overhead_pct_leto_phases",
        "ckpt_save_blocking_s",
    ):
        assert isinstance(out[key], float), key
    assert out["rmu_kind"] == "ResumableUpdater"  # the host-marked one: no CUDA here
    assert out["ckpt"]["round_trip_exact"] is True
    # The phase figure is the protected update's extra time plus the gradient parity.
    extra = out["rmu_update_ms"] - out["plain_update_ms"] + out["rmu_protect_ms"]
    plain_s = out["overhead"]["plain_iteration_s"]
    assert out["overhead_pct_phases"] == pytest.approx(100 * extra / (plain_s * 1e3))
