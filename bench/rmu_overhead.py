"""Protection overhead of the resumable model updater, measured in one process.

    PYTHONPATH=src python bench/rmu_overhead.py [--iterations 40] [--chunk-bytes N] [--threads 1]

Builds one rank of the demo job (`unbroken demo`'s config, its data shard 0 of 4) twice in this
process: with the plain updater (no parity, no transactions) and with the resumable updater on
local buffers laid out as the retained regions, then alternates their iterations (ABBA order)
and prints the median iteration time of each and the overhead. Same model, same data, same
threads, interleaved in time: unlike `unbroken bench recovery`'s 4-rank jobs run one after the
other, the machine's load drifts out of the difference. Single-threaded by default so that the
2-core machine's other processes disturb it least.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from unbroken.config.demo import demo_config
from unbroken.engine.replica import build_training
from unbroken.train import Trainer
from unbroken.update import PlainUpdater
from unbroken.update.layout import RetainedLayout
from unbroken.update.rmu import ResumableUpdater, state_from_regions


def _trainer(cfg, protected: bool) -> Trainer:
    regions: dict[str, torch.Tensor] = {}

    def allocate(layout, geometry, device):
        for spec in RetainedLayout.of(geometry, cfg.protection).regions():
            regions[spec.name] = torch.zeros(spec.nbytes, dtype=torch.uint8)
        return state_from_regions(layout, geometry, regions), True

    cpu = torch.device("cpu")
    built = build_training(cfg, n_shards=4, device=cpu, allocate=allocate if protected else None)
    if protected:
        upd = ResumableUpdater(built.state, built.geometry, built.step, regions, cfg.protection)
        upd.initialize(-1)
    else:
        upd = PlainUpdater(built.state, built.geometry, built.step)
    return Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=cpu,
        updater=upd,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40, help="timed iterations per variant")
    p.add_argument("--chunk-bytes", type=int, help="override protection.chunk_bytes")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = demo_config(quick=True)
    if args.chunk_bytes:
        prot = dataclasses.replace(cfg.protection, chunk_bytes=args.chunk_bytes)
        cfg = dataclasses.replace(cfg, protection=prot)
    plain, rmu = _trainer(cfg, False), _trainer(cfg, True)
    times: dict[str, list[float]] = {"plain": [], "rmu": []}
    for it in range(args.iterations + 2):
        order = [("plain", plain), ("rmu", rmu)]
        for name, tr in order if it % 2 else order[::-1]:
            t0 = time.perf_counter()
            tr.run_iteration(it)
            if it >= 2:  # the first two warm up allocators and caches
                times[name].append(time.perf_counter() - t0)
        if it % 10 == 9:
            print(f"  {it + 1}/{args.iterations + 2} iterations", file=sys.stderr)
    a, b = statistics.median(times["plain"]), statistics.median(times["rmu"])
    print(
        f"demo rank (shard 0 of 4), {args.threads} thread(s), {args.iterations} iterations each, "
        f"protection {cfg.protection}"
    )
    print(f"plain updater     {a * 1e3:8.1f} ms / iteration (median)")
    print(f"resumable updater {b * 1e3:8.1f} ms / iteration (median)")
    print(f"overhead          {100 * (b / a - 1):8.1f} %   ({(b - a) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
