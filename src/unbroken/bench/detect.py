"""Fail-slow detection accuracy and overhead: workload-aware detector vs Greyhound-style baseline.

Runs `--jobs` short real data-parallel training jobs (tiny reference model, stdlib corpus packed
into micro-batches of `--tokens` tokens with per-document attention, `--world-size` gloo ranks on
the CPU; `--device cuda`: NCCL, one GPU per rank, bf16, FlashAttention varlen kernels and
CUDA-event timings, e.g. `--preset 125m --tokens 32768 --microbatches 2`). In about half of
them (seeded) one rank gets a persistent `slow` fault (weak, medium or severe: the factor that
costs ~35/55/70% throughput, `unbroken.detect.levels`) at a random iteration after warm-up and
before the last part of the run. Then both detectors — ours (BOCPD on time over predicted time,
workload filter, validation) and the baseline (BOCPD on raw time, no filter) — replay the same
measured series, and the table compares them (ResiHP §8.2). Progress goes to stderr.
Figures are measured on whatever machine runs it; on a shared, loaded machine the timing noise
is part of what the detectors see.

`--latency` measures fail-stop detection instead: process exit, hang (SIGSTOP), agent SIGKILL and
agent SIGSTOP, `--repeats` times each on real runs, median and max against the bound the default
configuration implies (`unbroken.bench.detect_latency`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from unbroken.errors import UserError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to its subparser."""
    parser.add_argument("--jobs", type=int, default=6, help="training jobs (default 6)")
    parser.add_argument("--iterations", type=int, default=40, help="iterations per job")
    parser.add_argument("--world-size", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (N)")
    parser.add_argument("--microbatches", type=int, default=3, help="micro-batches per rank")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where ranks train (default cpu)"
    )
    parser.add_argument("--preset", default="tiny", help="reference model preset (default tiny)")
    parser.add_argument(
        "--workload",
        choices=("iid", "phases"),
        default="iid",
        help="iid: documents drawn independently each iteration (default); phases: runs of "
        "iterations with short documents (docs/detect.md)",
    )
    parser.add_argument(
        "--phase-iters", type=int, default=6, help="phases: iterations per phase (default 6)"
    )
    parser.add_argument(
        "--short-tokens", type=int, default=128, help="phases: longest short segment (128)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layers (default: 1 for tiny, else the preset's)"
    )
    parser.add_argument(
        "--heads", type=int, default=None, help="heads (default: 1 for tiny, else the preset's)"
    )
    parser.add_argument(
        "--what",
        choices=("compute", "comm", "mixed"),
        default="compute",
        help="what the injected fail-slows stretch (default compute; mixed alternates)",
    )
    parser.add_argument(
        "--pin-cpus", type=int, default=-1, help="pin rank r to CPU OFFSET+r (default: no)"
    )
    parser.add_argument("--out", default=None, help="keep the per-rank logs here")
    parser.add_argument(
        "--replay",
        nargs="+",
        default=None,
        help="score the logs already in these dirs (run no jobs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--latency",
        action="store_true",
        help="measure fail-stop detection latency (exit, hang, node loss) instead",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="--latency: measurements per kind (default 5)"
    )


def _schedule(n_jobs: int, iterations: int, world: int, seed: int, first: int, what: str) -> list:
    """Fault-free or one slow fault per job; about half faulty, levels round-robin; `what`:
    compute, comm, or mixed (alternating, compute first)."""
    from unbroken.bench.detect_jobs import BenchJob
    from unbroken.detect.levels import Level

    rng = random.Random(seed)
    faulty = set(rng.sample(range(n_jobs), (n_jobs + 1) // 2))
    levels = list(Level)
    jobs, k = [], 0
    for j in range(n_jobs):
        faults = []
        if j in faulty:
            level = levels[k % len(levels)]
            target = what if what != "mixed" else ("compute", "comm")[k % 2]
            k += 1
            it = rng.randrange(first, iterations - 8)
            rank = rng.randrange(world)
            faults.append(f"slow:rank={rank},iter={it},level={level.value},what={target}")
        jobs.append(BenchJob(index=j, seed=1000 * (seed + 1) + j, faults=faults))
    return jobs


def _recorded_setup(dirs: list[Path], given):
    """The job shape the replayed logs were recorded with (their `bench-spec.json`), so the
    report describes them and not this command's flags; `given` for logs without one.

    Raises:
        UserError: the directories were recorded with different shapes.
    """
    from unbroken.bench.detect_jobs import BenchSetup

    found = []
    for d in dirs:
        spec = d / "bench-spec.json"
        if spec.exists():
            found.append(BenchSetup(**json.loads(spec.read_text())["setup"]))
    if not found:
        return given
    shapes = {(s.world_size, s.tokens_per_microbatch, s.microbatches, s.describe()) for s in found}
    if len(shapes) > 1:
        raise UserError(f"--replay: the directories hold different job shapes: {sorted(shapes)}")
    return found[0]


def _run_latency(args: argparse.Namespace) -> int:
    from unbroken.bench.detect_latency import measure_latencies

    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    t0 = time.time()
    results = [r.to_dict() for r in measure_latencies(args.repeats, args.out)]
    if args.json:
        doc = {
            "latency": results,
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "load_avg": os.getloadavg(),
            "wall_s": time.time() - t0,
        }
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{'failure':32}{'n':>3}{'median s':>10}{'max s':>9}{'bound s':>9}  within  bound from")
    for r in results:
        cells = ["-" if r[k] is None else f"{r[k]:.3f}" for k in ("median_s", "max_s", "bound_s")]
        print(
            f"{r['kind']:32}{r['n']:>3}{cells[0]:>10}{cells[1]:>9}{cells[2]:>9}  "
            f"{'yes' if r['within_bound'] else 'NO':6}  {r['bound']}"
            + (f" ({r['premature']} runs lost the node early)" if r["premature"] else "")
        )
    print(f"load average {os.getloadavg()[0]:.1f}, {time.time() - t0:.0f} s")
    return 0


def _setup(args: argparse.Namespace, first: int):
    """The jobs' `BenchSetup` from the flags.

    Raises:
        UserError: an unknown preset, a shape `BenchSetup` rejects, or too few iterations.
    """
    from unbroken.bench.detect_jobs import BenchSetup
    from unbroken.model import PRESETS

    if args.preset not in PRESETS:
        raise UserError(f"--preset {args.preset!r} is unknown; choose one of {sorted(PRESETS)}")
    tiny = args.preset == "tiny"
    try:
        setup = BenchSetup(
            world_size=args.world_size,
            tokens_per_microbatch=args.tokens,
            microbatches=args.microbatches,
            iterations=args.iterations,
            pin_cpus=args.pin_cpus,
            preset=args.preset,
            n_layers=args.layers if args.layers is not None else (1 if tiny else None),
            n_heads=args.heads if args.heads is not None else (1 if tiny else None),
            device=args.device,
            workload=args.workload,
            phase_iters=args.phase_iters,
            short_tokens=args.short_tokens,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.iterations < first + 10:
        raise UserError(f"--iterations must be >= {first + 10} (warm-up + room for a fault)")
    return setup


def _log_dirs(args: argparse.Namespace, setup, first: int) -> tuple[object, list[Path]]:
    """(the setup the logs were recorded with, their directories): the `--replay` dirs, or one
    directory of freshly run jobs."""
    from unbroken.bench.detect_jobs import run_jobs

    if args.replay:
        dirs = [Path(d) for d in args.replay]
        for d in dirs:
            if not (d / "job0-rank0.jsonl").exists():
                raise UserError(f"--replay {d}: no job0-rank0.jsonl there")
        return _recorded_setup(dirs, setup), dirs
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="unbroken-detect-"))
    jobs = _schedule(args.jobs, args.iterations, args.world_size, args.seed, first, args.what)
    print(
        f"bench detect: {args.jobs} jobs x {args.iterations} iterations, "
        f"{args.world_size} ranks, N={args.tokens}, {args.microbatches} micro-batches/rank, "
        f"model {setup.describe()}, "
        f"{sum(bool(j.faults) for j in jobs)} with a fail-slow; logs in {out}",
        file=sys.stderr,
        flush=True,
    )
    try:
        run_jobs(setup, jobs, out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return setup, [out]


def run(args: argparse.Namespace) -> int:
    """Run (or replay) the jobs, score both detectors; print a table (or one JSON object)."""
    if args.latency:
        return _run_latency(args)
    from unbroken.bench.detect_evaluate import load_jobs
    from unbroken.bench.detect_report import print_summary, summarize
    from unbroken.detect.detector import DetectorConfig

    if args.jobs < 1:
        raise UserError("--jobs must be >= 1")
    cfg = DetectorConfig()
    first = cfg.skip_iters + cfg.warmup_iters + 3
    setup = _setup(args, first)
    t0 = time.time()
    setup, dirs = _log_dirs(args, setup, first)
    series = [job for d in dirs for job in load_jobs(d, setup.world_size)]
    print(f"scoring {len(series)} jobs (ours, baseline)...", file=sys.stderr, flush=True)
    result = summarize(series, setup, cfg, t0)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print_summary(result)
    return 0
