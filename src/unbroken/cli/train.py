"""`unbroken train`: run a job from a TOML config through failures."""

from __future__ import annotations

import argparse
import dataclasses
import json

from unbroken.config import JobConfig, load_config
from unbroken.errors import UserError
from unbroken.metrics.summary import format_table

__all__ = ["add_parser"]


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
    p.set_defaults(func=run)


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
    cfg = dataclasses.replace(cfg, **changes)
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
    print(json.dumps(summary, indent=1) if args.json else format_table(summary))
    ok = (
        summary["state"] == "done"
        and summary["failures_recovered"] == summary["failures_detected"]
        and not summary["faults_not_fired"]
    )
    if reference:
        ok = ok and summary.get("bit_exact", False)
    return 0 if ok else 1
