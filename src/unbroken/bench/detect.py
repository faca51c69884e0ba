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
import statistics
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


def _level_of(spec: str) -> str:
    """The level of a slow fault spec (`level=`, or the factor of older logs)."""
    from unbroken.detect.levels import LEVEL_LOSS, slow_factor_for

    if "level=" in spec:
        return spec.split("level=", 1)[1].split(",", 1)[0]
    factor = float(spec.rsplit("factor=", 1)[1].split(",", 1)[0])
    by_factor = {round(slow_factor_for(lv), 3): lv.value for lv in LEVEL_LOSS}
    return by_factor.get(round(factor, 3), f"{factor:g}")


def _measured_loss(jobs) -> dict[tuple[str, str], list[float]]:
    """Throughput loss each injected (what, level) really caused: 1 - 1 / the median, after
    the fault, of iteration time over the healthy time of the same workload, predicted by a
    workload model fitted on every healthy iteration before it (so that a phase of cheaper
    documents after the fault does not hide part of the loss, nor a costlier one add to it).
    Without per-rank timings: median iteration time after vs before."""
    from unbroken.detect.detector import mb_samples
    from unbroken.detect.workload import WorkloadPredictor

    out: dict[tuple[str, str], list[float]] = {}
    for job in jobs:
        if job.fault_iter is None:
            continue
        healthy = job.observations[2 : job.fault_iter]
        after = job.observations[job.fault_iter + 1 :]
        if not healthy or not after:
            continue
        samples = mb_samples(healthy)
        if samples:
            model = WorkloadPredictor.fit_data_parallel(
                samples, [(o.doc_lengths, o.seconds) for o in healthy]
            )
            ratio = statistics.median(
                o.seconds / model.iteration_time(o.doc_lengths) for o in after
            )
        else:
            ratio = statistics.median(o.seconds for o in after) / statistics.median(
                o.seconds for o in healthy
            )
        out.setdefault((job.fault_what, _level_of(job.fault_spec)), []).append(1.0 - 1.0 / ratio)
    return out


def _mean_active(jobs, level: str, key: str) -> float | None:
    """Mean of a comm fault's `slow_active` field over the jobs of one level."""
    values = [
        j.fault_active[key]
        for j in jobs
        if j.fault_what == "comm" and j.fault_active and _level_of(j.fault_spec) == level
    ]
    return statistics.fmean(values) if values else None


def _multi_doc_share(jobs) -> tuple[float, float]:
    """Share of micro-batches holding several documents; 5th percentile of sum l^2 / N^2."""
    multi, ratios = 0, []
    for job in jobs:
        for o in job.observations:
            for replica in o.doc_lengths:
                for d in replica:
                    multi += len(d) > 1
                    ratios.append(sum(x * x for x in d) / sum(d) ** 2)
    ratios.sort()
    return multi / max(1, len(ratios)), ratios[len(ratios) // 20] if ratios else 1.0


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


def run(args: argparse.Namespace) -> int:
    if args.latency:
        return _run_latency(args)
    from unbroken.bench.detect_evaluate import load_jobs, noise_diagnostics, score_jobs
    from unbroken.bench.detect_jobs import BenchSetup, run_jobs
    from unbroken.detect.detector import DetectorConfig
    from unbroken.detect.levels import LEVEL_LOSS, slow_factor_for

    if args.jobs < 1:
        raise UserError("--jobs must be >= 1")
    cfg = DetectorConfig()
    first = cfg.skip_iters + cfg.warmup_iters + 3
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
    t0 = time.time()
    if args.replay:
        dirs = [Path(d) for d in args.replay]
        for d in dirs:
            if not (d / "job0-rank0.jsonl").exists():
                raise UserError(f"--replay {d}: no job0-rank0.jsonl there")
        setup = _recorded_setup(dirs, setup)
    else:
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
        dirs = [out]
    series = [job for d in dirs for job in load_jobs(d, setup.world_size)]
    print(f"scoring {len(series)} jobs (ours, baseline)...", file=sys.stderr, flush=True)
    ours = score_jobs(series, cfg)
    base = score_jobs(series, DetectorConfig(baseline=True))
    strict = score_jobs(series, DetectorConfig(baseline=True, baseline_slowdowns_only=True))
    multi, q5 = _multi_doc_share(series)
    losses = _measured_loss(series)
    result = {
        "ours": ours.to_dict(),
        "baseline": base.to_dict(),
        "baseline_slowdowns_only": strict.to_dict(),
        "jobs": len(series),
        "faulty_jobs": sum(j.fault_iter is not None for j in series),
        "setup": {
            "world_size": setup.world_size,
            "iterations": setup.iterations,
            "tokens_per_microbatch": setup.tokens_per_microbatch,
            "microbatches_per_rank": setup.microbatches,
            "model": setup.describe(),
            "multi_doc_share": multi,
            "sum_sq_over_n2_p5": q5,
        },
        "noise": noise_diagnostics(series, cfg),
        "levels": {
            f"{what}/{lv.value}": {
                "factor": slow_factor_for(lv)
                if what == "compute"
                else _mean_active(series, lv.value, "factor"),
                "comm_share": _mean_active(series, lv.value, "comm_share")
                if what == "comm"
                else None,
                "target_loss": LEVEL_LOSS[lv],
                "measured_loss": statistics.fmean(losses[(what, lv.value)]),
                "jobs": len(losses[(what, lv.value)]),
            }
            for what in ("compute", "comm")
            for lv in LEVEL_LOSS
            if losses.get((what, lv.value))
        },
        "per_job": {"ours": ours.detail, "baseline": base.detail},
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "load_avg": os.getloadavg(),
        "wall_s": time.time() - t0,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    rows = [
        ("micro-batch time MAPE (%)", "mb_mape", "{:.2f}"),
        ("iteration time MAPE (%)", "iter_mape", "{:.2f}"),
        ("false alarms per job", "false_alarms_per_job", "{:.2f}"),
        ("validation s per false alarm", "validation_s_per_false_alarm", "{:.2e}"),
        ("accuracy", "accuracy", "{:.3f}"),
        ("detection delay (iterations)", "detect_delay_iters", "{:.2f}"),
        ("detector overhead (% of iter)", "overhead_pct", "{:.3f}"),
        ("benign points dropped per job", "benign_dropped_per_job", "{:.2f}"),
    ]
    modes = ("ours", "baseline", "baseline_slowdowns_only")
    print(f"{'':34}{'ours':>12}{'baseline':>12}{'(slowdowns)':>12}")
    for label, key, fmt in rows:
        cells = ["-" if result[m][key] is None else fmt.format(result[m][key]) for m in modes]
        print(f"{label:34}" + "".join(f"{c:>12}" for c in cells))
    print(
        f"jobs {result['jobs']} ({result['faulty_jobs']} faulty); multi-document micro-batches "
        f"{100 * multi:.1f}%, 5th pct of sum l^2/N^2 = {q5:.2f}"
    )
    noise = result["noise"]
    cpu, floor = noise["mb_mape_cpu"], noise["mb_mape_floor"]
    print(
        "timing noise: micro-batch MAPE on process CPU time "
        + ("-" if cpu is None else f"{cpu:.2f}%")
        + "; error of a perfect model on identical micro-batches "
        + ("-" if floor is None else f"{floor:.2f}%")
    )
    for lv, v in result["levels"].items():
        factor = "-" if v["factor"] is None else f"{v['factor']:.2f}"
        share = "" if v["comm_share"] is None else f" (comm share {v['comm_share']:.1%})"
        print(
            f"level {lv}: factor {factor}{share}, target loss {v['target_loss']:.0%}, "
            f"measured {v['measured_loss']:.0%} ({v['jobs']} jobs)"
        )
    return 0
