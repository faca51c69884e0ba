"""A DP x TP job across loopback hosts loses a node for good and shrinks that device's TP group
to its peer, then grows back when the node returns — both times moving the state between the
ranks' retained buffers (`RestoreMode.RESHARD`), never from a checkpoint (issue 18 item 3,
ResiHP §6.1 / Figure 8(c); `unbroken.launch.coordinator.adapt_lost`).

TP = 2 x DP = 2 on 4 nodes of one rank each (node r on 127.0.0.{r+1}). Node 1 (TP position 1
of replica 0) dies with its whole process tree. Device 0 runs replica 0 alone at TP 1,
computing as the TP-2 group (`unbroken.engine.emulate`), its stage received from replica 1.
Node 1 comes back: at a planned stop the launch plan returns, device 1 — a rank of no stage in
the plan the others hold — receiving its shard. Bit-exact against the fault-free run on the
launch plan.
"""

from __future__ import annotations

import pytest

from unbroken.bench.soak_watch import descendants

from .test_multinode import _kill_node, _summary, _wait, job_of  # noqa: F401 - the fixture

_GROUPS_SHRUNK = [([0], 1), ([1, 2], 2)]


def _groups(stages) -> list[tuple[list[int], int]]:
    return [(s["ranks"], s["tp"]) for s in sorted(stages, key=lambda s: s["replica"])]


@pytest.mark.slow  # 4 loopback nodes and a reference: ~90 s; CI: tests/adapt/test_lost_tp_shard.py
@pytest.mark.timeout(500)
def test_a_lost_nodes_tp_group_shrinks_and_grows_back_moving_the_state(job_of):  # noqa: F811
    job = job_of(iterations=40, adapt=True, join_timeout=240, tp=2, nnodes="4")
    nodes = {r: job.node(r) for r in (1, 2, 3)}
    node0 = job.node(0, "--reference")
    _wait(lambda: job.iterations_done() >= 5 or node0.poll() is not None, 240, "iteration 5")
    assert node0.poll() is None, node0.communicate()[1][-3000:]
    _kill_node(nodes[1].pid, descendants(nodes[1].pid) | {nodes[1].pid})
    _wait(lambda: job.kinds("recovery_done"), 90, "the survivors to train again", job)
    _wait(lambda: job.iterations_done() >= 12, 200, "training on the shrunk group", job)
    back = job.node(1)
    summary = _summary(node0, timeout=400)
    for p in (back, nodes[2], nodes[3]):
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
    assert summary["bit_exact"] is True, summary
    assert summary["iterations"] == 40 and summary["state"] == "done", summary
    lost, grow = job.kinds("replan")[:2]
    assert lost["trigger"]["kind"] == "device_lost" and lost["restore"] == "reshard", lost
    assert lost["devices_after"] == [0, 2, 3] and _groups(lost["after"]) == _GROUPS_SHRUNK
    assert grow["trigger"]["kind"] == "devices_returned" and grow["restore"] == "reshard", grow
    assert _groups(grow["after"]) == [([0, 1], 2), ([2, 3], 2)]
    assert not job.kinds("checkpoint_loaded"), "retained state and a replica, no checkpoint"
    assert [e["mode"] for e in job.kinds("recovery_start")][:2] == ["reshard", "reshard"]


@pytest.mark.slow  # 2 loopback nodes and a reference: ~60 s; CI: the decision in
# tests/adapt/test_lost_tp_shard.py::test_a_shrunk_pipeline_with_retained_state_grows_back_by_moving_it
@pytest.mark.timeout(500)
def test_a_shrunk_pipeline_grows_back_by_moving_its_retained_state(job_of):  # noqa: F811
    """PP = 4 (4 layers) over 2 nodes x 2 ranks: node 1 dies with stages 2 and 3, the only
    copies — node 0 runs PP 2 from the newest checkpoint. Node 1 comes back: the launch plan
    returns at a planned stop, node 0's retained state moved to its layout and node 1's ranks
    receiving theirs (`RestoreMode.RESHARD`), no second checkpoint load; bit-exact."""
    job = job_of(iterations=40, adapt=True, join_timeout=240, pp=4, layers=4, interval=4)
    node1 = job.node(1)
    node0 = job.node(0, "--reference")
    _wait(lambda: job.iterations_done() >= 7 or node0.poll() is not None, 240, "iteration 7")
    assert node0.poll() is None, node0.communicate()[1][-3000:]
    _kill_node(node1.pid, descendants(node1.pid) | {node1.pid})
    _wait(lambda: job.kinds("recovery_done"), 90, "node 0 to train again", job)
    _wait(lambda: job.iterations_done() >= 14, 200, "training on the shorter pipeline", job)
    back = job.node(1)
    summary = _summary(node0, timeout=400)
    _, err = back.communicate(timeout=60)
    assert back.returncode == 0, err[-3000:]
    assert summary["bit_exact"] is True, summary
    assert summary["iterations"] == 40 and summary["state"] == "done", summary
    lost, grow = job.kinds("replan")[:2]
    assert lost["restore"] == "checkpoint" and lost["devices_after"] == [0, 1], lost
    assert grow["trigger"]["kind"] == "devices_returned" and grow["restore"] == "reshard", grow
    assert len(grow["after"]) == 4
    assert len(job.kinds("checkpoint_loaded")) == 1  # the loss's; the return moved the state
    moved = job.kinds("state_moved")
    assert sorted(e["rank"] for e in moved) == [0, 1, 2, 3]
    assert all(e["bytes_in"] > 0 for e in moved if e["rank"] in (2, 3))
