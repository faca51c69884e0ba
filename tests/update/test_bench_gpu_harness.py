"""`unbroken bench gpu`'s harness, run on the CPU (`--device cpu` smoke-tests it; the figures
are for the H200 only): one run prints every headline key with a value, the resumable update
and the checkpoint round trip included (slow tier, about 20 s: a benchmark's harness); the
jobs' takeover figures from a run's logs (CI)."""

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


def test_the_jobs_report_each_takeovers_attach_and_first_iteration(tmp_path):
    import json

    from unbroken.bench.gpu import _takeovers

    ready = [
        {"kind": "trainer_ready", "generation": g, "attach_s": a, "map_s": 0.01, "premapped": p}
        for g, a, p in ((0, 9.0, 0), (1, 0.2, 7), (2, 0.1, 7))
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ready))
    rows = [(0, 0, 2.5, 0), (0, 1, 1.0, 0), (0, 2, 3.1, 2), (1, 3, 1.4, 0), (1, 4, 0.9, 0)]
    rows.append((2, 5, 9.2, 8))  # its first iteration saved a checkpoint (8 s blocked)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"generation": g, "iter": i, "iter_s": s, "ckpt_s": c}) + "\n"
            for g, i, s, c in rows
        )
    )
    got = _takeovers(tmp_path)
    assert got["attach_s"] == [0.2, 0.1] and [r["premapped"] for r in got["attach"]] == [7, 7]
    # Each recovered generation's first, without a checkpoint's blocked time.
    assert got["first_iteration_s"] == pytest.approx([1.4, 1.2])
    assert got["first_iteration_saved"] == [False, True]
    assert got["second_iteration_s"] == pytest.approx([0.9])  # generation 2 ran only one
    assert got["steady_iteration_s"] == pytest.approx(1.0)  # of 1.0, 1.1, 0.9: no first


def test_the_kill_campaigns_job_saves_synchronously_unless_asked_otherwise():
    """`--kill-async-ckpt`: with synchronous saves most uniformly drawn kills land inside a
    save (stop 46, 28 of 30), whose redo then dominates each recovery."""
    import argparse

    from unbroken.bench.gpu import add_arguments, kill_config

    def cfg(*extra: str):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return kill_config(p.parse_args(["--kill-preset", "tiny", "--kills-per-run", "3", *extra]))

    sync, asyn = cfg(), cfg("--kill-async-ckpt")
    assert (sync.checkpoint.interval, sync.checkpoint.asynchronous) == (4, False)
    assert (asyn.checkpoint.interval, asyn.checkpoint.asynchronous) == (4, True)
    assert sync.recovery.mode == "inplace" and sync.recovery.shadow_level == 3
    assert sync.train.iterations == 12 + 6 * 2 and sync.model.preset == "tiny"
