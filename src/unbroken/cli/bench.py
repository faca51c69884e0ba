"""`unbroken bench NAME`: benchmarks that print their figures and the ratio to a baseline measured
in the same run. Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser"]

# name -> module. A benchmark whose module is absent from this checkout is not offered.
BENCHMARKS = {
    "erasure": "unbroken.cli.bench_erasure",
    "faults": "unbroken.cli.bench_faults",
    "recovery": "unbroken.cli.bench_recovery",
    "detect": "unbroken.cli.bench_detect",
    "engine": "unbroken.engine.bench",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
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
