"""`unbroken bench NAME`: benchmarks that print their figures and the ratio to a baseline measured
in the same run. This module only builds their parsers and dispatches: each benchmark's harness is
a module of `unbroken.bench` exposing `add_arguments(parser)` (its flags) and
`run(args) -> int` (the run, returning the exit status).

A harness is imported only when its benchmark runs (or its `--help` is asked for): harnesses
import torch and the runtime, which every other `unbroken` command would otherwise pay for
(~2.5 s per invocation) just to build the command line.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["BENCHMARKS", "add_parser"]

BENCHMARKS = {
    "erasure": (
        "unbroken.bench.erasure",
        "Reed–Solomon codec throughput (encode, fused update, reconstruct) vs ISA-L and zfec.",
    ),
    "faults": (
        "unbroken.bench.faults",
        "Fault-injection campaign: random hardware-operable failures (and page losses) at random "
        "phases, recovered and compared bit for bit.",
    ),
    "recovery": (
        "unbroken.bench.recovery",
        "Recovery benchmark: protection overhead and per-failure recovery time, in-place vs "
        "checkpoint-restart.",
    ),
    "detect": (
        "unbroken.bench.detect",
        "Fail-slow detection accuracy and overhead: workload-aware detector vs Greyhound-style "
        "baseline.",
    ),
    "engine": (
        "unbroken.bench.engine",
        "Engine throughput vs torch.distributed.pipelining's schedules, and simulator accuracy.",
    ),
    "gpu": (
        "unbroken.bench.gpu",
        "In-place recovery at scale on one GPU: MFU, update and protection overhead, recovery "
        "and checkpoint times.",
    ),
    "plan": (
        "unbroken.bench.plan",
        "Scheduler benchmark: ResiHP §8.3-8.4 scenarios, ours against Greyhound, Adaptra, "
        "ReCycle and Oobleck.",
    ),
    "adapt": (
        "unbroken.bench.adapt",
        "Live reconfiguration: tokens/s after a slow or lost device, with and without re-planning.",
    ),
    "soak": (
        "unbroken.bench.soak",
        "Soak: the demo job for --minutes through a failure every 10-30 s; asserts no leak, "
        "bit-exactness and no decay of iteration or recovery time.",
    ),
}
"""Subcommand name -> (harness module, one-line help)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `bench` and one subcommand per benchmark to the `unbroken` parser."""
    parser = sub.add_parser("bench", help="run a benchmark (prints figures and baseline ratios)")
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = bench_sub.add_parser(name, help=help_text, add_help=False)
        bench_parser.add_argument("bench_args", nargs=argparse.REMAINDER)
        bench_parser.set_defaults(func=_runner(name, module_name))


def _runner(name: str, module_name: str):
    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(
            prog=f"unbroken bench {name}", description=(module.__doc__ or "").split("\n")[0]
        )
        module.add_arguments(parser)
        return module.run(parser.parse_args(args.bench_args))

    return run
