"""`unbroken bench NAME`: benchmarks that print their figures and the ratio to a baseline measured
in the same run. This module only builds their parsers and dispatches: each benchmark's harness is
a module of `unbroken.bench` exposing `add_arguments(parser)` (its flags) and
`run(args) -> int` (the run, returning the exit status)."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["BENCHMARKS", "add_parser"]

BENCHMARKS = {
    "erasure": "unbroken.bench.erasure",
    "faults": "unbroken.bench.faults",
    "recovery": "unbroken.bench.recovery",
    "detect": "unbroken.bench.detect",
    "engine": "unbroken.bench.engine",
    "gpu": "unbroken.bench.gpu",
    "plan": "unbroken.bench.plan",
}
"""Subcommand name -> harness module. A benchmark whose module is absent from this checkout is
not offered."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `bench` and one subcommand per benchmark to the `unbroken` parser."""
    parser = sub.add_parser("bench", help="run a benchmark (prints figures and baseline ratios)")
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        bench_parser = bench_sub.add_parser(name, help=(module.__doc__ or "").split("\n")[0])
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(func=module.run)
