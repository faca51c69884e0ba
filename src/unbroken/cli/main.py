"""Entry point of the `unbroken` command: builds the parser from the subcommand modules and maps
`UserError` to one line on stderr and exit status 2 (a traceback only with `--debug`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from unbroken.errors import JobFailed, UserError

__all__ = ["build_parser", "main"]

# Subcommand modules, each exposing add_parser(subparsers). Order is the order in --help.
SUBCOMMANDS = (
    "unbroken.cli.demo",
    "unbroken.cli.train",
    "unbroken.cli.simulate",
    "unbroken.cli.report",
    "unbroken.cli.plan",
    "unbroken.cli.bench",
)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the usage is one `--help` away)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="unbroken",
        description="Fault-tolerant runtime for hybrid-parallel LLM training.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks: of user errors, and of a training rank that fails (always in "
        "its log)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subcommand not built in this checkout
                continue
            raise
        module.add_parser(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; a benchmark's own flags (`unbroken bench NAME ...`) are handed to it
    whole, since its parser is built only when it runs (`unbroken.cli.bench`)."""
    from unbroken.cli.bench import BENCHMARKS

    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    is_bench = first is not None and argv[first : first + 1] == ["bench"]
    if is_bench and len(argv) > first + 1 and argv[first + 1] in BENCHMARKS:
        args = parser.parse_args([*argv[: first + 2]])
        args.bench_args = argv[first + 2 :]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, sys.argv[1:] if argv is None else list(argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"unbroken: error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        if args.debug:
            traceback.print_exc()
        print(f"unbroken: job failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("unbroken: interrupted", file=sys.stderr)
        return 130
