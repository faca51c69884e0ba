"""`unbroken train`: run a job from a TOML config through failures."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

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
    add_node_flags(p)
    p.set_defaults(func=run)


def add_node_flags(p: argparse.ArgumentParser) -> None:
    """The multi-node flags (torchrun's names; docs/multinode.md)."""
    g = p.add_argument_group(
        "multi-node",
        "run the same command on every node, each with its --node-rank (or let the "
        "environment say: NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT, or SLURM's). Node 0 runs "
        "the coordinator; the others join it.",
    )
    g.add_argument(
        "--nnodes",
        metavar="N[:M]",
        help="nodes in the job (nodes.count); N:M lets M - N spare nodes join (nodes.spares)",
    )
    g.add_argument("--node-rank", type=int, metavar="R", help="this node's rank, 0..N-1")
    g.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address and the coordinator's port (default port 29400)",
    )
    g.add_argument(
        "--nproc-per-node", type=int, metavar="K", help="ranks per node (nodes.ranks_per_node)"
    )
    g.add_argument(
        "--local-addr", metavar="ADDR", help="this node's address (its agent connects from it)"
    )
    g.add_argument(
        "--secret-file",
        metavar="F",
        help="the job secret every node shares, in a file of mode 0600 (or set "
        "UNBROKEN_JOB_SECRET); never on the command line",
    )


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


def _nodes(cfg: JobConfig, join, per_node: int | None):
    """`cfg.nodes` with the launch's node count and ranks per node."""
    changes = {}
    if join is not None:
        changes["count"] = join.nnodes
        changes["spares"] = join.spares
    if per_node is not None:
        changes["ranks_per_node"] = per_node
    try:
        return dataclasses.replace(cfg.nodes, **changes)
    except ValueError as exc:
        raise UserError(f"{exc} (--nnodes/--nproc-per-node)") from None


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
    import os
    from pathlib import Path

    from unbroken.launch.rendezvous import load_secret, resolve_join

    join = resolve_join(args.nnodes, args.node_rank, args.rdzv_endpoint, os.environ)
    if join is not None and join.node_rank > 0:
        from unbroken.launch.agent.loop import serve_node

        # Keep trying to join for the job's nodes.join_timeout_s, and at least a minute (node 0
        # may still be starting, or running its reference); the config is node 0's to apply,
        # read here for that.
        patience = max(60.0, load_config(JobConfig, args.config).nodes.join_timeout_s)
        print(
            f"unbroken: node {join.node_rank} of {join.nnodes}"
            + (" (a spare)" if join.node_rank >= join.nnodes else "")
            + f" joining {join.endpoint} "
            f"({join.source}; trying for {patience:g} s)",
            file=sys.stderr,
        )
        return serve_node(
            join.endpoint, join.node_rank, args.local_addr, args.secret_file, patience
        )
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
    if join is not None or args.nproc_per_node is not None:
        changes["nodes"] = _nodes(cfg, join, args.nproc_per_node)
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
        join=join,
        secret=load_secret(args.secret_file, os.environ) if join is not None else None,
    )
    print(json.dumps(summary.to_dict(), indent=1) if args.json else format_table(summary))
    return 0 if summary.ok else 1
