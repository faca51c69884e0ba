"""Where one iteration of the GPU `bench detect` job spends its time (one GPU, one rank).

    PYTHONPATH=src python bench/detect_profile.py TOKENS PRESET [cpu-geometry]   # 8192 125m

Builds the bench's model and loss in this process (the preset's layers and heads, bf16
autocast, varlen attention, PhaseTimer with CUDA events; the device-default protection geometry,
not the bench jobs' pinned 80-page stripes of `unbroken.bench.detect_jobs._job_config`), prints
per-iteration micro-batch times, then compute / sync / update seconds
measured with synchronization, and `torch.profiler` key averages of one compute phase. The
N = 8,192 figures in bench/results/detect-h200.md (121 ms of kernels in a 227 ms compute phase;
0.23 s of update with the CPU protection geometry, 1,160 chunks) came from the scratch version
of this script on the H200, before protection sizes followed the device; `cpu-geometry` asks for
that geometry (64 KiB pages, 32 KiB chunks) again. Re-run in this form on one H200
(bench/results/detect-profile-h200.txt): with `cpu-geometry` 1,160 chunks and 0.20 s of update,
121.7 ms of kernels in a 0.19-0.22 s compute phase; with the GPU geometry 76 chunks, 0.014 s.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from unbroken.bench.detect_varlen import varlen_loss
from unbroken.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ProtectionConfig,
    TrainConfig,
)
from unbroken.detect.timing import PhaseTimer
from unbroken.engine.replica import build_training
from unbroken.train import Trainer
from unbroken.update import PlainUpdater


def main(tokens: int, preset: str, cpu_geometry: bool) -> None:
    dev = torch.device("cuda", 0)
    sizes = {"page_bytes": 64 << 10, "chunk_bytes": 32 << 10} if cpu_geometry else {}
    cfg = JobConfig(
        model=ModelConfig(preset=preset),
        data=DataConfig(tokens_per_microbatch=tokens, microbatches=3, seed=1),
        train=TrainConfig(iterations=40, seed=1),
        checkpoint=CheckpointConfig(enabled=False),
        protection=ProtectionConfig(**sizes),
    )
    b = build_training(cfg, n_shards=1, device=dev)
    timer = PhaseTimer(rank=0, device=dev)
    upd = PlainUpdater(b.state, b.geometry, b.step)
    print("update chunks", len(upd.chunks), "params", b.state.params.numel())
    tr = Trainer(
        model=b.model,
        state=b.state,
        source=b.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=dev,
        autocast_dtype=torch.bfloat16,
        hooks=[timer],
        updater=upd,
        loss_fn=varlen_loss,
    )
    for it in range(6):
        r = tr.run_iteration(it)
        timer.flush()
        rec = timer.records[-1]
        print(
            it,
            f"iter {r.t_end - r.t_start:.3f} s, mb ms",
            [round(x * 1e3, 1) for x in rec.mb_s],
            "documents",
            [len(d) for d in r.doc_lengths],
        )
    torch.cuda.synchronize()
    for it in range(6, 9):
        t0 = time.perf_counter()
        local_loss, _, _ = tr.compute(it)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        _, _, scale = tr.sync(it, local_loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        with torch.no_grad():
            tr.update(it, 1e-4, scale)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"compute {t1 - t0:.3f} s, sync {t2 - t1:.3f} s, update {t3 - t2:.3f} s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tr.compute(9)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["cpu-geometry"]):
        sys.exit("usage: detect_profile.py TOKENS PRESET [cpu-geometry]")
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["cpu-geometry"])
