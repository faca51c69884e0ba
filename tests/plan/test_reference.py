"""The planner decides exactly as the code before the planning-speed work did: every reference
state (`tests.plan.reference`: the bench's 256- and 4,096-GPU planning states, a bench job's
fail-slow and fail-stop states under every bench policy, seeded random states under four planner
configurations) gives the recorded layout, predicted times, explanation, action lists and
simulated timeline, bit for bit."""

from __future__ import annotations

import json

import pytest

from tests.plan.reference import FIXTURE, cases

RECORDED = json.loads(FIXTURE.read_text())
CASES = dict(cases())


def test_every_recorded_case_is_generated():
    assert set(CASES) == set(RECORDED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decisions_match_the_recording(name):
    assert CASES[name]() == RECORDED[name]
