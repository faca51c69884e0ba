"""Shared builders for the parallel tests: unit cost tables and action-list surgery."""

from __future__ import annotations

import dataclasses

from unbroken.parallel import Action, Costs, ParallelPlan, parse_action


def unit_costs(f: float = 1.0, b: float = 1.0, w: float = 0.0, **kw: object) -> Costs:
    """The same F/B/W cost on every virtual stage."""
    table = {}
    for k in range(64):
        table.update({(k, "F"): f, (k, "B"): b, (k, "W"): w})
    return Costs(compute=table, **kw)  # type: ignore[arg-type]


def with_actions(plan: ParallelPlan, rank: int, actions: list[Action]) -> ParallelPlan:
    """A copy of `plan` with one rank's action list replaced."""
    new = dict(plan.actions)
    new[rank] = tuple(actions)
    return dataclasses.replace(plan, actions=new)


def index_of(plan: ParallelPlan, rank: int, text: str) -> int:
    """Position of the action written `text` in a rank's list."""
    return plan.actions[rank].index(parse_action(text))
