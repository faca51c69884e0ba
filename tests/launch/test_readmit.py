"""A lost node that comes back (issue 19, item 3), decided by the coordinator's core: with
`adapt` a fresh agent of the node is re-admitted and the job stops its running generation (a
planned stop, no restart counted) to start the next one on the launch world, its returned
ranks filled from a replica; without `adapt` it is refused, the caller fences it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from unbroken.config import AdaptConfig, NodesConfig
from unbroken.devices import DeviceRegistry
from unbroken.launch.coordinator.core import CoordinatorCore
from unbroken.launch.coordinator.monitor import RunMonitor
from unbroken.launch.coordinator.nodes import Endpoints, NodeLayout
from unbroken.messages import (
    Hello,
    MemoryReport,
    NodeBeat,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
)
from unbroken.metrics.log import JsonlLog, read_jsonl
from unbroken.recovery import RecoveryState

from ..foundation.conftest import tiny_job


class TwoNodes:
    """The core of a 2 nodes x 2 ranks job; what it sends is recorded per node."""

    def __init__(self, tmp_path, adapt: bool, spares: int = 0) -> None:
        cfg = tiny_job(world_size=4)
        cfg = dataclasses.replace(
            cfg,
            adapt=AdaptConfig(enabled=adapt),
            nodes=NodesConfig(count=2, spares=spares),
        )
        self.log = tmp_path / "events.jsonl"
        events = JsonlLog(self.log, run="train")
        monitor = RunMonitor(tmp_path, "train", 4, cfg.train.iterations, events, quiet=True)
        self.sent: list[tuple[int, object]] = []
        self.core = CoordinatorCore(
            cfg,
            tmp_path,
            "train",
            layout=NodeLayout.even(2, 2),
            endpoints=Endpoints(store_port=1),
            send=lambda node, msg: self.sent.append((node, msg)),
            events=events,
            monitor=monitor,
            store=None,
        )

    def take(self) -> list[tuple[int, object]]:
        out, self.sent[:] = list(self.sent), []
        return out

    def started(self, generation: int, nodes) -> None:
        for node in nodes:
            self.core.handle(
                node, Started(generation=generation, t=1.0, promoted=False, shadows_ready=0)
            )

    def stopped(self, generation: int, nodes) -> None:
        for node in nodes:
            self.core.handle(node, Stopped(generation=generation, t=2.0, took_s=0.1))

    def records(self, kind: str) -> list[dict]:
        return [e for e in read_jsonl(self.log) if e["kind"] == kind]


def _node_1_lost(job: TwoNodes) -> None:
    """Both nodes joined, generation 0 ran, then node 1 was lost."""
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    assert {n for n, m in job.take() if isinstance(m, StartGeneration)} == {0, 1}
    job.started(0, (0, 1))
    job.core.node_lost(1, "its connection closed")


def _running_without_node_1(job: TwoNodes) -> None:
    _node_1_lost(job)
    assert job.take() == [(0, StopGeneration(generation=0))]
    job.stopped(0, (0,))
    (start,) = job.take()
    assert start[0] == 0 and start[1].ranks == [0, 1] and start[1].generation == 1
    job.started(1, (0,))
    assert job.core.fsm.state is RecoveryState.RUNNING and job.core.fsm.restarts == 1


def test_a_fresh_agent_of_a_lost_node_is_readmitted_and_the_launch_world_returns(tmp_path):
    job = TwoNodes(tmp_path, adapt=True)
    _running_without_node_1(job)
    assert job.core.readmit(1, Hello(node=1, pid=4242, host="127.0.0.2")) is True
    assert job.take() == [(0, StopGeneration(generation=1))]  # only node 0 runs trainers
    assert job.core.fsm.state is RecoveryState.STOPPING
    job.core.handle(1, Hello(node=1, pid=4242))  # its later messages are accepted
    job.stopped(1, (0,))
    starts = {n: m for n, m in job.take() if isinstance(m, StartGeneration)}
    assert sorted(starts) == [0, 1]
    assert starts[0].ranks == [0, 1] and starts[1].ranks == [2, 3]
    assert starts[1].devices == {"2": 2, "3": 3} and starts[1].world_changed is True
    assert job.core.devices == (0, 1, 2, 3)
    assert job.core.fsm.restarts == 1, "the planned stop is not a restart"
    (ret,) = job.records("node_returned")
    assert ret["node"] == 1 and ret["devices"] == [2, 3]
    replans = job.records("replan")
    assert [r["trigger"]["kind"] for r in replans] == ["device_lost", "devices_returned"]
    assert replans[1]["devices_after"] == [0, 1, 2, 3] and replans[1]["counts_after"] == [2] * 4
    job.started(2, (0, 1))
    assert job.core.fsm.state is RecoveryState.RUNNING and job.take() == []


def test_a_node_returning_while_a_generation_starts_grows_once_it_runs(tmp_path):
    job = TwoNodes(tmp_path, adapt=True)
    _node_1_lost(job)
    job.stopped(0, (0,))
    job.take()  # generation 1 starting on node 0
    assert job.core.readmit(1, Hello(node=1, pid=1)) is True
    assert job.take() == [] and job.core.fsm.state is RecoveryState.RESTARTING
    job.started(1, (0,))  # now it runs: the planned stop follows
    assert job.take() == [(0, StopGeneration(generation=1))]


def test_without_adapt_a_returning_node_is_refused(tmp_path):
    job = TwoNodes(tmp_path, adapt=False)
    _node_1_lost(job)
    assert job.core.fsm.state is RecoveryState.FAILED
    assert job.core.readmit(1, Hello(node=1, pid=1)) is False and 1 in job.core.gone


def test_an_old_agent_of_a_lost_node_is_refused_only_a_fresh_one_returns(tmp_path):
    # The agent that ran generation 0 reconnects after a partition: its trainers of that
    # generation may still run, so it is not re-admitted (the caller fences it). A fresh
    # agent of the same node is.
    job = TwoNodes(tmp_path, adapt=True)
    _running_without_node_1(job)
    assert job.core.readmit(1, Hello(node=1, pid=4242, generation=0)) is False
    assert 1 in job.core.gone and job.take() == [] and not job.records("node_returned")
    assert job.core.readmit(1, Hello(node=1, pid=4343)) is True
    assert 1 not in job.core.gone


def test_node_messages_that_claim_a_generation_the_job_never_started_are_refused(tmp_path):
    job = TwoNodes(tmp_path, adapt=True)
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    job.started(0, (0, 1))
    job.core.handle(1, NodeBeat(t=1.0, trainers=2, generation=0))  # the running one: fine
    job.core.handle(1, NodeBeat(t=1.0, trainers=0, generation=-1))  # before its first: fine
    with pytest.raises(ValueError, match="claims generation 1; the job is at 0"):
        job.core.handle(1, NodeBeat(t=1.0, trainers=2, generation=1))
    with pytest.raises(ValueError, match="claims generation 5"):
        job.core.handle(0, Hello(node=0, pid=1, generation=5))


def test_the_shutdown_and_memory_reports_carry_the_generation(tmp_path):
    job = TwoNodes(tmp_path, adapt=True)
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    job.started(0, (0, 1))
    report = MemoryReport(event="memory_report", t=1.0, fields={"rss_mb": 5}, generation=0)
    job.core.handle(1, report)
    (logged,) = job.records("memory_report")
    assert logged["node_generation"] == 0 and logged["rss_mb"] == 5
    job.core.give_up("test over")
    shutdowns = [m for _, m in job.take() if isinstance(m, Shutdown)]
    assert shutdowns and {m.generation for m in shutdowns} == {0}


def _spare_joins(job: TwoNodes) -> None:
    job.core.handle(2, Hello(node=2, pid=7, host="127.0.0.3"))
    (joined,) = job.records("spare_joined")
    assert joined["node"] == 2


def _spare_waits(job: TwoNodes) -> None:
    _spare_joins(job)
    assert job.take() == [] and job.core.standby.keys() == {2}  # it runs nothing


def test_a_spare_in_waiting_takes_a_lost_nodes_devices_at_once(tmp_path):
    job = TwoNodes(tmp_path, adapt=True, spares=1)
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    assert {n for n, m in job.take() if isinstance(m, StartGeneration)} == {0, 1}
    job.started(0, (0, 1))
    _spare_waits(job)
    DeviceRegistry(job.core.registry).mark_lost(3, "lose fault on node 1")
    job.core.node_lost(1, "its connection closed")
    (promoted,) = job.records("spare_promoted")
    assert (promoted["node"], promoted["replaces"], promoted["devices"]) == (2, 1, [2, 3])
    assert DeviceRegistry(job.core.registry).lost(3) is None  # the spare's own hardware
    assert job.take() == [(0, StopGeneration(generation=0))]  # the failure's stop
    job.stopped(0, (0,))
    starts = {n: m for n, m in job.take() if isinstance(m, StartGeneration)}
    # No smaller world between: the recovery's generation runs the launch world on the spare.
    assert sorted(starts) == [0, 2] and starts[2].ranks == [2, 3]
    assert starts[2].devices == {"2": 2, "3": 3} and starts[2].world_changed is True
    assert [r["trigger"]["kind"] for r in job.records("replan")] == ["devices_returned"]
    job.started(1, (0, 2))
    assert job.core.fsm.state is RecoveryState.RUNNING and job.take() == []
    # Node 1's host comes back: its devices are the spare's now, so it waits as a spare.
    assert job.core.readmit(1, Hello(node=1, pid=9)) is True
    assert job.core.standby.keys() == {1} and job.take() == []
    job.core.give_up("test over")
    assert sorted(n for n, m in job.take() if isinstance(m, Shutdown)) == [0, 1, 2]


def test_a_spare_that_joins_after_the_loss_grows_the_job_back(tmp_path):
    job = TwoNodes(tmp_path, adapt=True, spares=1)
    _running_without_node_1(job)
    _spare_joins(job)
    assert job.core.standby == {}  # taken at once
    assert job.take() == [(0, StopGeneration(generation=1))]  # the planned stop
    job.stopped(1, (0,))
    starts = {n: m for n, m in job.take() if isinstance(m, StartGeneration)}
    assert sorted(starts) == [0, 2] and starts[2].ranks == [2, 3]
    assert job.core.fsm.restarts == 1, "the planned stop is not a restart"


def test_a_lost_spare_in_waiting_is_no_failure(tmp_path):
    job = TwoNodes(tmp_path, adapt=True, spares=1)
    for node in (0, 1):
        job.core.handle(node, Hello(node=node, pid=os.getpid()))
    job.take()
    job.started(0, (0, 1))
    _spare_waits(job)
    job.core.node_lost(2, "beats stopped")
    assert job.core.fsm.state is RecoveryState.RUNNING and job.take() == []
    assert not job.records("failure_detected") and job.records("spare_lost")
    assert 2 not in job.core.gone  # a fresh agent of it may join again as a spare
    with pytest.raises(ValueError, match="spare nodes: \\[2\\]"):
        job.core.handle(3, Hello(node=3, pid=1))
