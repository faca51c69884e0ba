"""The ResiHP scheduler: plan around failed and slow devices (ResiHP §6).

Owns the decision half of adaptive hybrid parallelism: given a `ClusterState` (every device's
health — healthy, slow with its measured speed p_i, lost — its memory and node, the running
`ParallelPlan`, the per-layer workload), `plan_for_state` returns a new plan (a `Layout` with
standbys and stage migrations; `PlanResult.plan()` gives its action lists) and an explanation of
every step, with the predicted iteration time before and after:

- `exclusion` (§6.1): selective TP device exclusion, eq. 4, node-local standbys;
- `repartition` (§6.2): layer repartition and in-flight reordering chosen by the simulator;
- `migration` (§6.3): Algorithm 1, progress-aware stage migration across DP replicas;
- `score`: every candidate is timed by `unbroken.parallel.simulate` (on an exactly equivalent
  reduced plan), the same DAG the fail-slow detector uses — one model of the schedule;
- `baselines`: Greyhound, Adaptra, ReCycle, Oobleck and their strengthened forms as planners
  over the same simulator, for `unbroken bench plan`.

What it must never do: start processes, touch process groups or clocks in its decisions, or
import the launch/recovery/cli/bench layers. The coordinator (issue 18) calls it and executes
the plan; docs/scheduler.md explains each step with worked numbers.
"""

from unbroken.plan.exclusion import NoPlanError, Selection
from unbroken.plan.layout import Layout
from unbroken.plan.planner import PlannerConfig, PlanResult, StepReport, plan_for_state
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState, Device, DeviceStatus
from unbroken.plan.workload import Fabric, Workload

__all__ = [
    "ClusterState",
    "Device",
    "DeviceStatus",
    "Fabric",
    "Layout",
    "NoPlanError",
    "PlanResult",
    "PlannerConfig",
    "Scorer",
    "Selection",
    "StepReport",
    "Workload",
    "plan_for_state",
]
