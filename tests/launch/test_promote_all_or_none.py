"""Shadows promoted on one node while another starts fresh trainers regroup
(`CoordinatorCore._regroup`, `StartGeneration.regroup`): promoted L3 shadows keep their own
group, a mirror world of every node's shadows, so one node promoting while another starts
fresh trainers (its shadows not spawned yet: its fork server still importing) left the
promoted ones waiting for the other node's shadows until the collective timeout (seen once in
tests/launch/test_multinode.py under load). Each node's beat says which generation every one of
its ranks has a live shadow for (`NodeBeat.shadows_for`); the coordinator's core decides from
the last beats, and the agents then promote only parked shadows, into the generation's own
group, as in a changed world. The agent's side is tested in test_agent.py."""

from __future__ import annotations

import os

from unbroken.messages import Hello, NodeBeat, RankExited, StartGeneration, StopGeneration

from .test_readmit import TwoNodes


def _failed_in_generation_0(job: TwoNodes, shadows_for: dict[int, int]) -> dict[int, object]:
    """Both nodes joined and ran generation 0 with these beats; rank 3 (node 1) crashed.
    Returns the next generation's start messages by node."""
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    assert {n for n, m in job.take() if isinstance(m, StartGeneration)} == {0, 1}
    job.started(0, (0, 1))
    for node, gen in shadows_for.items():
        job.core.handle(node, NodeBeat(t=1.5, trainers=2, generation=0, shadows_for=gen))
    job.core.handle(
        1, RankExited(rank=3, generation=0, returncode=-9, t=2.0, completed=5, iteration=6)
    )
    stops = job.take()
    assert sorted(n for n, m in stops if isinstance(m, StopGeneration)) == [0, 1]
    job.stopped(0, (0, 1))
    return {n: m for n, m in job.take() if isinstance(m, StartGeneration)}


def test_shadows_keep_their_group_when_every_node_has_live_shadows(tmp_path):
    job = TwoNodes(tmp_path, adapt=False)
    starts = _failed_in_generation_0(job, {0: 1, 1: 1})
    assert sorted(starts) == [0, 1] and all(m.generation == 1 for m in starts.values())
    assert [m.regroup for m in starts.values()] == [False, False]
    assert job.records("shadows_regroup") == []


def test_shadows_regroup_when_one_node_has_no_live_shadows(tmp_path):
    job = TwoNodes(tmp_path, adapt=False)
    starts = _failed_in_generation_0(job, {0: 1, 1: -1})
    assert sorted(starts) == [0, 1]
    assert [m.regroup for m in starts.values()] == [True, True]
    (event,) = job.records("shadows_regroup")
    assert event["generation"] == 1 and event["shadows_for"] == {"0": 1, "1": -1}
