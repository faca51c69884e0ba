"""A promoted trainer's first iterations, without a job: a fresh process runs the shadow's
warm-up (`unbroken.shadow.warm.warm_cuda`), builds the protected, lending 1b trainer of
`unbroken bench gpu` and times its first iterations (per micro-batch forward and total, the
update, new allocator segments).

Run on a GPU machine: `PYTHONPATH=src python bench/first_iteration.py VARIANT [--iterations N]`
with VARIANT `warmed` (as a promoted shadow: lends from its first micro-batch) or `unwarmed`
(the first compute phase unlent, as before `unbroken.update.lending.mark_warmed`). Results:
`bench/results/gpu-h200.md`, stop 45.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from unbroken.bench.gpu import _build, _job
from unbroken.detect.timing import PhaseTimer
from unbroken.shadow.warm import warm_cuda
from unbroken.update import lending


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("variant", choices=("warmed", "unwarmed"))
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--preset", default="1b")
    args = p.parse_args()
    cfg = _job(
        argparse.Namespace(preset=args.preset, tokens=4096, device="cuda", tokenizer="bytes"), 4
    )
    dev = torch.device("cuda", 0)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    warm_cuda(cfg, dev)
    print(f"[{args.variant}] warm-up {time.perf_counter() - t0:.2f} s")
    if args.variant == "unwarmed":
        lending._WARMED = False  # the behaviour before mark_warmed
    trainer, upd, *_ = _build(cfg, dev, protected=True, lend=True)
    timer = PhaseTimer(0, device=dev)
    trainer.hooks.append(timer)
    for i in range(args.iterations):
        before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        trainer.run_iteration(i)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        timer.flush()
        rec = timer.records[-1]
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - before
        print(
            f"[{args.variant}] iteration {i}: {dt:.3f} s, forward per micro-batch "
            f"{[round(x, 3) for x in rec.forward_s]}, update {upd.update_s[-1] * 1e3:.1f} ms, "
            f"new segments {segments}, lent phases {trainer.lending.lent_phases}"
        )


if __name__ == "__main__":
    main()
