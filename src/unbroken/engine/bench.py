"""Engine throughput vs torch.distributed.pipelining's schedules, and simulator accuracy.

For the demo model (preset `small`) on 4 local gloo ranks, four plans — 1F1B with PP=2 × DP=2,
PP=4, PP=2 on 2 of the ranks (the other two stand by, so on a 2-core machine each active rank
has a core), and interleaved 1F1B with PP=2, v=2 on 2 ranks — run with our worker interpreter
and with `torch.distributed.pipelining` (`PipelineStage` + `Schedule1F1B`, or
`ScheduleInterleaved1F1B` for the interleaved plan) on the same stage split, initial values,
micro-batches, loss scaling, DP reduction and optimizer, alternating in blocks within one run. It prints tokens/s
of both and their ratio, and the dry-run simulator's predicted iteration time (fed with the
per-action means our run measured, the one-way link time of one activation and the DP
all-reduce measured alone) against the measured median, with the error in percent. Progress
goes to stderr. On a 2-core machine 4 ranks share 2 cores, so both engines are CPU-bound and
timing noise is large; the figures hold for the machine and load they were measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from unbroken.errors import UserError
from unbroken.launch.ranks import run_ranks

__all__ = ["add_arguments", "run"]

WORLD_SIZE = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to its subparser."""
    parser.add_argument("--preset", default="small", help="model preset (default: small)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="micro-batches per replica (>= 4 for PP=4)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per engine")
    parser.add_argument("--block", type=int, default=3, help="iterations per timed block")
    parser.add_argument("--rounds", type=int, default=4, help="timed blocks per engine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the 4-rank gloo comparison; cuda: TP=PP=DP=1 on one GPU vs a plain loop",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _plans(args: argparse.Namespace) -> dict:
    from unbroken.config import ModelConfig
    from unbroken.model import resolve_args
    from unbroken.parallel import make_plan

    layers = resolve_args(ModelConfig(preset=args.preset)).n_layers
    if layers < 4:
        raise UserError(f"preset {args.preset!r} has {layers} layers; PP=4 needs at least 4")
    if args.microbatches < 4 or args.microbatches % 2:
        raise UserError(
            "--microbatches must be even and at least 4 (Schedule1F1B needs M >= PP, "
            "interleaving a multiple of PP)"
        )
    m = args.microbatches
    return {
        "1f1b pp=2 dp=2": make_plan(2, 2, 1, layers, m, "1f1b"),
        "1f1b pp=4": make_plan(1, 4, 1, layers, m, "1f1b"),
        # 2 of the 4 ranks (the others stand by): a core per active rank on a 2-core machine
        "1f1b pp=2 (2 ranks)": make_plan(1, 2, 1, layers, m, "1f1b"),
        "interleaved v=2 (2 ranks)": make_plan(
            1, 2, 1, layers, m, "interleaved_1f1b", virtual_stages=2
        ),
    }


def _launch(spec: dict, tmp: Path) -> dict:
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    run_ranks(
        "unbroken.engine._bench_ranks", [str(path)], WORLD_SIZE, spec["threads"], "bench engine"
    )
    return json.loads(Path(spec["result"]).read_text())


def _predict(plan, measured: dict) -> float:
    from unbroken.parallel import Costs, simulate

    profiles = measured["profiles"]

    def compute(work) -> float:
        rank = plan.replicas[work.replica].stages[work.stage].ranks[0]
        return profiles[rank].get(f"{work.kind}{work.stage}", 0.0)

    costs = Costs(
        compute=compute,
        link=measured["link"],
        reduce_grad=measured["reduce_grad"],
        # OPT_STEP as timed includes waiting for the slowest rank in the loss/norm all-reduce;
        # the rank that arrives last waits least, so its time is the closest to the local cost.
        opt_step=min(p["OPT_STEP"] for p in profiles if "OPT_STEP" in p),
    )
    timeline = simulate(plan, costs)
    if not timeline.ok:
        raise RuntimeError(f"simulator: {timeline.deadlocks[0]}")
    return timeline.iteration_time


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    if args.device == "cuda":
        return _run_cuda(args)
    plans = _plans(args)
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-engine-") as tmp:
        spec = {
            "preset": args.preset,
            "tokens": args.tokens,
            "microbatches": args.microbatches,
            "max_documents": 2000,
            "warmup": args.warmup,
            "block": args.block,
            "rounds": args.rounds,
            "threads": args.threads,
            "world_size": WORLD_SIZE,
            "store": str(Path(tmp) / "store"),
            "result": str(Path(tmp) / "result.json"),
            "plans": {name: plan.to_json() for name, plan in plans.items()},
        }
        print(f"bench engine: {len(plans)} plans on {WORLD_SIZE} gloo ranks", file=sys.stderr)
        measured = _launch(spec, Path(tmp))
    results = []
    for name, plan in plans.items():
        m = measured[name]
        ours = statistics.median(m["times"]["ours"])
        base = statistics.median(m["times"]["baseline"])
        tokens = args.tokens * plan.total_microbatches
        predicted = _predict(plan, m)
        results.append(
            {
                "plan": name,
                "tokens_per_s": tokens / ours,
                "baseline_tokens_per_s": tokens / base,
                "ratio": base / ours,
                "predicted_iter_s": predicted,
                "measured_iter_s": ours,
                "baseline_iter_s": base,
                "prediction_error_pct": 100.0 * (predicted - ours) / ours,
                "link_s": m["link"],
                "reduce_grad_s": m["reduce_grad"],
            }
        )
    setup = {
        "preset": args.preset,
        "tokens_per_microbatch": args.tokens,
        "microbatches_per_replica": args.microbatches,
        "timed_iterations": args.block * args.rounds,
        "world_size": WORLD_SIZE,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps({"setup": setup, "results": results}, indent=2))
        return 0
    print(
        f"{args.preset}, {args.tokens} tokens x {args.microbatches} micro-batches per replica, "
        f"{WORLD_SIZE} gloo ranks on {os.cpu_count()} CPUs (load average "
        f"{setup['load_average_1m']:.1f}), median of {args.block * args.rounds} iterations each"
    )
    head = (
        f"{'plan':<26} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>6} "
        f"{'measured s':>11} {'predicted s':>12} {'error':>7}"
    )
    print(head)
    for r in results:
        print(
            f"{r['plan']:<26} {r['tokens_per_s']:>11.0f} {r['baseline_tokens_per_s']:>12.0f} "
            f"{r['ratio']:>6.2f} {r['measured_iter_s']:>11.3f} {r['predicted_iter_s']:>12.3f} "
            f"{r['prediction_error_pct']:>+6.1f}%"
        )
    return 0


def _run_cuda(args: argparse.Namespace) -> int:
    import torch

    from unbroken.engine._bench_gpu import run_gpu

    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible")
    r = run_gpu(args.preset, args.tokens, args.microbatches, args.warmup, args.block, args.rounds)
    if args.json:
        print(json.dumps({"results": [r]}, indent=2))
        return 0
    print(
        f"{args.preset} on {r['device']}, {args.tokens} tokens x {args.microbatches} "
        f"micro-batches, bf16 autocast, median of {args.block * args.rounds} iterations each"
    )
    print(
        f"ours {r['tokens_per_s']:.0f} tok/s ({r['measured_iter_s'] * 1e3:.1f} ms/iter), plain loop "
        f"{r['baseline_tokens_per_s']:.0f} tok/s ({r['baseline_iter_s'] * 1e3:.1f} ms/iter), "
        f"ratio {r['ratio']:.3f}"
    )
    return 0
