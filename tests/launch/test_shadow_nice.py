"""Shadows run nicer than the job only where the agent can give a promoted one the job's
priority back (`shadow_nice`): an unprivileged agent cannot lower a niceness, and a promoted
shadow left at +10 would hold its peers back at every collective for the rest of the run."""

from __future__ import annotations

import resource

import pytest

from unbroken.launch.agent import supervisor
from unbroken.launch.agent.supervisor import SHADOW_NICE, shadow_nice


def _as(monkeypatch, euid: int, rlimit_nice: int) -> None:
    monkeypatch.setattr(supervisor.os, "geteuid", lambda: euid)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (rlimit_nice, rlimit_nice))


@pytest.mark.parametrize(
    ("euid", "rlimit", "job", "want"),
    [
        (0, 0, 0, SHADOW_NICE),  # root may restore any niceness
        (1000, 0, 0, 0),  # the usual user limit: nothing below the current niceness
        (1000, 20, 0, SHADOW_NICE),  # RLIMIT_NICE 20: down to niceness 0
        (1000, 20, -5, 0),  # ... but not below it
        (1000, 15, 5, SHADOW_NICE),  # a job under `nice -n 5`, allowed down to 5
    ],
)
def test_shadows_are_niced_only_where_promotion_can_undo_it(monkeypatch, euid, rlimit, job, want):
    _as(monkeypatch, euid, rlimit)
    assert shadow_nice(job) == want
