"""The planner decides exactly as the code before the planning-speed work did: every reference
state (`tests.plan.reference`: the bench's 256- and 4,096-GPU planning states, a bench job's
fail-slow and fail-stop states under every bench policy, seeded random states under four planner
configurations) gives the recorded layout, predicted times, explanation, action lists and
simulated timeline, bit for bit."""

from __future__ import annotations

import gc
import json

import pytest

from tests.plan.reference import FIXTURE, bench_state, cases, random_state
from unbroken.plan import NoPlanError, PlannerConfig, plan_for_state

RECORDED = json.loads(FIXTURE.read_text())
CASES = dict(cases())


def test_every_recorded_case_is_generated():
    assert set(CASES) == set(RECORDED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decisions_match_the_recording(name):
    assert CASES[name]() == RECORDED[name]


@pytest.mark.parametrize("case", ["random/3", "random/8", "qwen2.5-7b/link", "llama2-13b/mixed"])
def test_planning_leaves_no_reference_cycles(case):
    """The planner pauses the cyclic collector while it runs (`planner._collector_paused`),
    which costs nothing only if its garbage needs no collector: none is left behind."""
    if case.startswith("random/"):
        cluster, lay = random_state(int(case.split("/")[1]))
    else:
        _, lay, cluster = bench_state(*case.split("/"))
    for config in (PlannerConfig(), PlannerConfig(ownership=False)):
        try:
            plan_for_state(cluster, config, current=lay)  # warm: first-time imports, caches
        except NoPlanError:
            return
        gc.collect()
        was = gc.isenabled()
        gc.disable()
        try:
            plan_for_state(cluster, config, current=lay)
            assert gc.collect() == 0
        finally:
            if was:
                gc.enable()
