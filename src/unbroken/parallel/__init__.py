"""Hybrid-parallel engine: the plan IR, pipeline schedules as action lists, and their simulator.

Owns the value every other part of unbroken uses to talk about a parallel layout
(ResiHP §5.2, §6, §7):

- `plan`: `ParallelPlan` — DP replicas x PP (virtual) stages, each stage an ordered TP group of
  ranks (a power of two, free to differ between stages and replicas) and a layer range,
  micro-batch ownership and stage-level migration, and every rank's action list. JSON in, JSON
  out; equal inputs give equal plans on every rank.
- `actions`: `Action`, the steps of an action list and their text form (``0F3``,
  ``1SEND_F2->r5``, ``2RECV_B0[1/2]<-r7``, ``REDUCE_GRAD``, ``OPT_STEP``).
- `schedules`: GPipe, 1F1B, interleaved 1F1B and ZB-H1 orders, with point-to-point batches
  placed so blocking sends cannot deadlock and heterogeneous-TP messages split into max(a, b)
  chunks.
- `check` / `simulate` / `costs`: static coherence checks and the dependency-driven replay
  (eq. 2) that gives start/end of every action, bubbles, the critical path and deadlocks. The
  fail-slow detector, the scheduler and the cluster simulator reuse it.

What it must never do: hold process groups or any module-level mutable state (re-planning
builds a new plan; it never mutates one), import torch (these modules run in the coordinator and
in tools), or execute anything — the worker interpreter that runs a plan on torch.distributed
lives elsewhere and consumes this IR. See docs/parallel.md.
"""

from unbroken.parallel.actions import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, parse_action
from unbroken.parallel.check import Problem, check_plan, match_transfers, transfer_key
from unbroken.parallel.costs import Costs, NodeLinks, Work
from unbroken.parallel.placement import DataPlacement
from unbroken.parallel.plan import (
    Migration,
    ParallelPlan,
    Replica,
    StageGroup,
    held_stages,
    make_plan,
    plan_for,
    same_layouts,
    split_layers,
)
from unbroken.parallel.schedules import SCHEDULES, compute_orders, generate_actions, p2p_chunks
from unbroken.parallel.simulate import (
    DeadlockError,
    TimedAction,
    Timeline,
    iteration_time,
    simulate,
    timeline_csv,
)

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Costs",
    "DataPlacement",
    "DeadlockError",
    "Migration",
    "NodeLinks",
    "ParallelPlan",
    "Problem",
    "Replica",
    "StageGroup",
    "TimedAction",
    "Timeline",
    "Work",
    "check_plan",
    "compute_orders",
    "generate_actions",
    "held_stages",
    "iteration_time",
    "make_plan",
    "match_transfers",
    "p2p_chunks",
    "parse_action",
    "plan_for",
    "same_layouts",
    "simulate",
    "split_layers",
    "timeline_csv",
    "transfer_key",
]
