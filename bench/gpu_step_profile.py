"""Where the time of one training iteration goes on the GPU (issue 16): the reference model's
iteration under the trainers' settings and variants of them, then a torch.profiler table.

    PYTHONPATH=src python bench/gpu_step_profile.py [--preset 1b] [--out DIR]

Builds one plain-updater trainer as `unbroken bench gpu` does and times `--iterations`
iterations per variant: deterministic algorithms on (the trainers' setting) with torch's
fill of uninitialized memory on and off, and deterministic algorithms off. Then profiles one
iteration of the trainers' setting and prints the kernels by total device time, the device
time summed over kernels against the wall time, and writes a Chrome trace to DIR.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--out", default=".")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from unbroken.bench.gpu import _build, _job, _model_flops

    args = argparse.Namespace(
        preset=a.preset, tokens=a.tokens, microbatches=a.microbatches, device="cuda"
    )
    cfg = _job(args, a.microbatches)
    dev = torch.device("cuda")
    torch.use_deterministic_algorithms(True)
    trainer, *_ = _build(cfg, dev, protected=False)
    it = 0

    def timed(name: str) -> float:
        nonlocal it
        res = []
        for _ in range(a.iterations):
            res.append(trainer.run_iteration(it))
            it += 1
        s = statistics.median(r.seconds for r in res)
        flops, _ = _model_flops(trainer.model, res)
        print(f"{name:40s} {s:.3f} s/iter  MFU {flops / len(res) / s / 989e12:.3f}", flush=True)
        return s

    for _ in range(2):
        trainer.run_iteration(it)
        it += 1
    out: dict = {}
    out["det_fill"] = timed("deterministic, fill uninitialized")
    torch.utils.deterministic.fill_uninitialized_memory = False
    out["det_nofill"] = timed("deterministic, no fill")
    torch.use_deterministic_algorithms(False)
    out["nondet"] = timed("not deterministic")
    torch.use_deterministic_algorithms(True)
    if a.compile:
        from unbroken.model import compile_blocks

        compile_blocks(trainer.model)
        trainer.run_iteration(it)
        trainer.run_iteration(it + 1)
        it += 2
        out["compiled_det_nofill"] = timed("compiled, deterministic, no fill")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.run_iteration(it)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events)
    print(
        f"profiled iteration: wall {wall:.3f} s, device time over all ops {kernel_us / 1e6:.3f} s"
    )
    table = events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70)
    print(table)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "step-profile.txt").write_text(table)
    trace = Path(a.out) / "step-trace.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    out["profiled_wall_s"] = wall
    out["profiled_device_s"] = kernel_us / 1e6
    (Path(a.out) / "step-profile.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
