"""`unbroken train`: run a job from a TOML config through failures."""

from __future__ import annotations

import argparse
import dataclasses
import json

from unbroken.config import JobConfig, load_config
from unbroken.errors import UserError
from unbroken.metrics.summary import format_table

__all__ = ["add_metrics_flags", "add_parser", "metrics_config"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train from a config file (TOML) with fault tolerance")
    p.add_argument("--config", required=True, help="job config (TOML); see examples/")
    p.add_argument("--out", default="runs/train", help="output dir (default: runs/train)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help='fault to inject, e.g. "kill:rank=1,iter=12,phase=update" (repeatable)',
    )
    p.add_argument("--iterations", type=int, help="override train.iterations")
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run a fault-free reference and compare (default: on when faults are injected)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse a job whose memory estimate exceeds the device (default: warn)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_metrics_flags(p)
    p.set_defaults(func=run)


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """`--metrics-port` and `--metrics-host` (the `[metrics]` config section)."""
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics at http://HOST:N/metrics and a live status page at "
        "http://HOST:N/ while the job runs (0: any free port; default: off). Metrics: "
        "iterations, tokens/s, loss, recoveries by mode and fault class with a duration "
        "histogram, shadow readiness, fail-slow reports, ETTR so far, and unbroken_replans_total "
        "(live re-plans, adapt.enabled)",
    )
    p.add_argument(
        "--metrics-host",
        metavar="ADDR",
        help="address the metrics server binds (default: 127.0.0.1, this machine only)",
    )


def metrics_config(cfg: JobConfig, args: argparse.Namespace) -> JobConfig:
    """`cfg` with the metrics flags applied.

    Raises:
        UserError: a port outside 0..65535 or an empty host.
    """
    from unbroken.errors import UserError

    changes = {}
    if args.metrics_port is not None:
        changes["port"] = args.metrics_port
    if args.metrics_host is not None:
        changes["host"] = args.metrics_host
    if not changes:
        return cfg
    try:
        return dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, **changes))
    except ValueError as exc:
        raise UserError(f"{exc} (--metrics-port/--metrics-host)") from None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        cfg = load_config(JobConfig, args.config)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{args.config}: cannot read the config ({exc})") from None
    changes = {}
    if args.inject:
        changes["inject"] = [*cfg.inject, *args.inject]
    if args.iterations is not None:
        if args.iterations < 1:
            raise UserError(f"--iterations {args.iterations}: give at least 1")
        changes["train"] = dataclasses.replace(cfg.train, iterations=args.iterations)
    cfg = metrics_config(dataclasses.replace(cfg, **changes), args)
    reference = args.reference if args.reference is not None else bool(cfg.inject)
    from unbroken.api import run_job  # after the config: a bad one fails without importing torch

    summary = run_job(
        cfg,
        args.out,
        reference=reference,
        search_path=[str(Path(args.config).resolve().parent)],
        quiet=args.quiet,
        debug=args.debug,
        source=args.config,
        strict=args.strict,
    )
    print(json.dumps(summary.to_dict(), indent=1) if args.json else format_table(summary))
    return 0 if summary.ok else 1
