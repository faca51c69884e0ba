"""`unbroken plan`: run the scheduler on a cluster state and print its plan and explanation.

`unbroken plan --example MODEL > state.json` writes the state of one of the bench's jobs (ResiHP
Table 3 layouts) with one GPU lost and one slow, to edit; `unbroken plan state.json` plans
around it (`--json` for the plan IR, `--actions` for every rank's action list). The state format
is `unbroken.plan.ClusterState.to_dict`. See docs/scheduler.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unbroken.errors import UserError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = sub.add_parser(
        "plan",
        help="plan around failed and slow devices (ResiHP scheduler) for a cluster state",
        description=(
            "Re-plan TP groups, layer split and micro-batch placement around the lost and slow "
            "devices of a cluster state (JSON), and explain every step."
        ),
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("state", nargs="?", metavar="STATE_JSON", help="a ClusterState as JSON")
    what.add_argument("--example", metavar="MODEL", help="print an example state of a bench job")
    parser.add_argument("--json", action="store_true", help="print the plan IR (with actions)")
    parser.add_argument("--actions", action="store_true", help="print every rank's actions")
    parser.set_defaults(func=run)


def _example(model: str) -> str:
    from unbroken.bench._plan_jobs import JOBS, initial_layout, initial_state
    from unbroken.sim.presets import load_hardware

    if model not in JOBS:
        raise UserError(f"--example {model!r}: choose one of {', '.join(JOBS)}")
    spec = JOBS[model]
    state = initial_state(spec, load_hardware("a100"), 80 * 2**30)
    layout = initial_layout(spec)
    state = state.with_lost(layout.group(0, 0).ranks[1]).with_slow(
        layout.group(1, spec.pp - 1).ranks[0], speed=0.5
    )
    return json.dumps(state.to_dict(), indent=1)


def run(args: argparse.Namespace) -> int:
    from unbroken.plan import ClusterState, NoPlanError, plan_for_state

    if args.example:
        print(_example(args.example))
        return 0
    path = Path(args.state)
    try:
        state = ClusterState.from_dict(json.loads(path.read_text()))
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a cluster state ({exc})") from None
    try:
        result = plan_for_state(state)
    except NoPlanError as exc:
        raise UserError(f"{path}: {exc}") from None
    if args.json:
        print(result.plan().to_json(indent=1))
        return 0
    print(result.explain())
    if args.actions:
        print(result.plan().describe())
    return 0
