"""`unbroken demo`: the main job on the embedded default, end to end.

The small reference model on 4 local CPU ranks (gloo): first a fault-free reference run, then
the same job with injected failures — a crash in the middle of the optimizer update, a crash with
lost retained pages during the parity write-back, an exception in the backward pass and, without
--quick, a hung rank, a page loss beyond parity tolerance (filled from a data-parallel replica) and a crash
inside a progress-marker write — recovered in place, and a table comparing the two. A
data-parallel demo re-plans around its slow rank once the detector reports it (`adapt.enabled`,
on unless --no-adapt): the slow rank's micro-batches move to its peers at an iteration
boundary, and the re-plan is printed when it happens and in the final table. The run's
HTML report (`report.html`, `unbroken.cli.report`) is written next to its logs. With --nodes 2
the ranks run on two local "hosts" and node 1 is lost near the end (`unbroken.cli.demo_nodes`). Exit status 0
only when every injected failure was recovered and the final state is bit-identical to the
reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from unbroken.cli.demo_nodes import SecondNode, two_nodes
from unbroken.cli.train import add_metrics_flags, metrics_config
from unbroken.config import ParallelConfig
from unbroken.config.demo import demo_config
from unbroken.metrics.summary import format_table

__all__ = ["add_parser", "demo_config"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="reference run + run with failures on 4 local CPU ranks")
    p.add_argument("--quick", action="store_true", help="shorter run (under 90 s on 2 cores)")
    p.add_argument("--out", default="runs/demo", help="output dir (default: runs/demo)")
    p.add_argument("--world-size", type=int, default=4, help="ranks (default: 4)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default: 1)")
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved", "zb_h1"),
        help="pipeline schedule when --pp > 1 (default: 1f1b)",
    )
    p.add_argument(
        "--adapt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-plan around lost and slow devices: the slow rank's micro-batches move to its "
        "peers (adapt.enabled; data-parallel runs; default: on)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: run the ranks on two local 'hosts' (node 1 connects from 127.0.0.2) and lose "
        "node 1 near the end; the job re-plans onto node 0 (implies --adapt)",
    )
    p.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write report.html in the output dir (default: on)",
    )
    add_metrics_flags(p)
    p.set_defaults(func=run)


def _report(out: str) -> str | None:
    """Write the run's HTML report; a report that cannot be written never fails the demo."""
    from unbroken.cli.report import make_report

    try:
        return str(make_report(out))
    except Exception as exc:  # the demo's verdict stands without its report
        print(f"unbroken: no report ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    from unbroken.api import run_job
    from unbroken.errors import UserError

    cfg = demo_config(args.quick)
    if args.world_size < 3:
        raise UserError("--world-size must be at least 3 (the demo injects faults on ranks 0-2)")
    try:
        parallel = ParallelConfig(
            world_size=args.world_size,
            tp=args.tp,
            pp=args.pp,
            schedule=args.schedule,
            virtual_stages=2 if args.schedule == "interleaved" else 1,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.nodes > 1 and parallel.planned:
        raise UserError("--nodes 2 runs the data-parallel demo (a node loss re-plans DP jobs)")
    enabled = (args.adapt or args.nodes > 1) and not parallel.planned
    adapt = dataclasses.replace(cfg.adapt, enabled=enabled)
    cfg = metrics_config(dataclasses.replace(cfg, parallel=parallel, adapt=adapt), args)
    t0 = time.time()
    if args.nodes > 1:
        cfg = two_nodes(cfg)
        with SecondNode() as node1:
            summary = run_job(
                cfg,
                args.out,
                reference=True,
                debug=args.debug,
                source="unbroken demo",
                join=node1.join,
                secret=node1.secret,
            )
    else:
        summary = run_job(cfg, args.out, reference=True, debug=args.debug, source="unbroken demo")
    report = _report(args.out) if args.report else None
    if args.json:
        print(json.dumps(summary.to_dict(), indent=1))
    else:
        print()
        print(format_table(summary))
        print(
            f"\nfinished in {time.time() - t0:.1f}s; outputs in {args.out}/ "
            "(summary.json, events.jsonl, metrics.jsonl, plot.png)"
        )
        if report:
            print(f"report: {report} (open it in a browser)")
    return 0 if summary.ok and summary.bit_exact is True else 1
