"""Fail-stop decisions reach recovery through the detectors' one interface: the coordinator's
core turns an agent's `RankExited` / `RankHung` and its own node-loss decisions into
`DetectionEvent(kind=FAIL_STOP)`, logs them and hands them to `RecoveryMachine.on_detection`.

No trainer processes: the test plays the agent over a real authenticated channel to a real
`ControlServer`, so every message crosses the same framing, HMAC and validation as in a job."""

from __future__ import annotations

import os
import socket

import pytest

from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.launch.coordinator import (
    ControlServer,
    CoordinatorCore,
    Endpoints,
    NodeLayout,
    RunMonitor,
)
from unbroken.launch.coordinator.server import Dropped, Received
from unbroken.launch.protocol import FROM_COORDINATOR, Channel
from unbroken.messages import (
    Hello,
    Message,
    RankExited,
    RankHung,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
)
from unbroken.metrics.log import JsonlLog, read_jsonl
from unbroken.recovery import RecoveryMachine, RecoveryState, Stop

from ..foundation.conftest import tiny_job


def _stop(cause: FailStopCause, **kw) -> DetectionEvent:
    return DetectionEvent(kind=DetectionKind.FAIL_STOP, cause=cause, **kw)


def _running() -> RecoveryMachine:
    fsm = RecoveryMachine(world_size=2, max_restarts=3, retains_state=True)
    fsm.begin()
    fsm.on_started(0)
    return fsm


def test_fsm_acts_on_fail_stop_events_by_cause():
    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.EXIT, rank=1, generation=0, returncode=-9))
    assert isinstance(act, Stop) and fsm.state is RecoveryState.STOPPING
    assert "rank 1 exited with status -9" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.HANG, rank=0, generation=0, silent_s=1.6))
    assert isinstance(act, Stop) and "hung (no heartbeat for 1.60s)" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.NODE_LOST, rank=None, node=0, reason="closed"))
    assert act.reason == "closed" and fsm.state is RecoveryState.FAILED


def test_fsm_ignores_stale_generations_and_fail_slow_reports():
    fsm = _running()
    assert fsm.on_detection(_stop(FailStopCause.EXIT, rank=1, generation=7, returncode=1)) is None
    slow = DetectionEvent(kind=DetectionKind.FAIL_SLOW, rank=1, stage=0, factor=2.0)
    assert fsm.on_detection(slow) is None
    assert fsm.state is RecoveryState.RUNNING


def test_fsm_rejects_a_fail_stop_event_without_its_fields():
    with pytest.raises(ValueError, match="returncode"):
        _running().on_detection(_stop(FailStopCause.EXIT, rank=1, generation=0))
    with pytest.raises(ValueError, match="not a valid FailStopCause"):
        _running().on_detection(_stop("melted", rank=1, generation=0))  # type: ignore[arg-type]


class Job:
    """A coordinator core behind a real control server, and the test as node 0's agent."""

    def __init__(self, tmp_path) -> None:
        secret = os.urandom(32)
        cfg = tiny_job()
        self.log = tmp_path / "events.jsonl"
        events = JsonlLog(self.log, run="train")
        monitor = RunMonitor(tmp_path, "train", 2, cfg.train.iterations, events, quiet=True)
        self.server = ControlServer("127.0.0.1", secret)
        self.core = CoordinatorCore(
            cfg,
            tmp_path,
            "train",
            layout=NodeLayout.single(cfg.parallel.world_size),
            endpoints=Endpoints(store_port=1),
            send=self.server.send,
            events=events,
            monitor=monitor,
            store=None,
        )
        self.monitor = monitor
        monitor.slow_watch.detector.sink = self.core  # as the coordinator wires it
        sock = socket.create_connection(("127.0.0.1", self.server.port))
        self.agent = Channel(sock, secret, FROM_COORDINATOR)

    def tell(self, msg: Message) -> list[Received | Dropped]:
        """Send `msg` as the agent; deliver what the server received to the core."""
        self.agent.send(msg)
        got: list[Received | Dropped] = []
        while not got:
            got = self.server.poll(timeout=5)
        for item in got:
            if isinstance(item, Received):
                self.core.handle(item.node, item.message)
        return got

    def heard(self) -> Message:
        return self.agent.recv_blocking(timeout=5)

    def records(self, kind: str) -> list[dict]:
        return [e for e in read_jsonl(self.log) if e["kind"] == kind]


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    j.tell(Hello(node=0, pid=os.getpid()))
    start = j.heard()
    assert isinstance(start, StartGeneration) and start.generation == 0 and start.ranks == [0, 1]
    j.tell(Started(generation=0, t=1.0, promoted=False, shadows_ready=0))
    assert j.core.fsm.state is RecoveryState.RUNNING
    yield j
    j.server.close()


def test_rank_exit_becomes_a_fail_stop_event_logged_and_acted_on(job):
    seen: list[DetectionEvent] = []
    emit = job.core.emit
    job.core.emit = lambda e, **kw: (seen.append(e), emit(e, **kw))  # type: ignore[method-assign]
    job.tell(RankExited(rank=1, generation=0, returncode=-9, t=5.0, iteration=3, phase="update"))
    (event,) = seen
    assert (event.kind, event.cause, event.rank, event.returncode, event.iteration) == (
        DetectionKind.FAIL_STOP,
        FailStopCause.EXIT,
        1,
        -9,
        3,
    )
    (rec,) = job.records("failure_detected")
    assert rec["rank"] == 1 and rec["generation"] == 0 and rec["t_detected"] == 5.0
    assert rec["reason"] == "exited with status -9" and rec["detect_s"] is None
    assert (rec["iter"], rec["phase"], rec["injected"]) == (3, "update", None)
    assert rec["detection"] == "fail_stop" and rec["cause"] == "exit" and rec["returncode"] == -9
    assert job.core.fsm.state is RecoveryState.STOPPING
    assert job.heard() == StopGeneration(generation=0)


def test_a_finished_rank_is_not_a_failure(job):
    job.tell(RankExited(rank=0, generation=0, returncode=0, t=1.0))
    assert job.records("failure_detected") == []
    assert job.core.fsm.state is RecoveryState.RUNNING and job.core.fsm.finished_ranks == {0}


def test_rank_hung_becomes_a_fail_stop_event(job):
    job.tell(RankHung(rank=0, generation=0, silent_s=1.7, t=2.0))
    (rec,) = job.records("failure_detected")
    assert (
        rec["cause"] == "hang" and rec["silent_s"] == 1.7 and rec["reason"] == "hung (silent 1.70s)"
    )
    assert job.core.fsm.state is RecoveryState.STOPPING
    assert job.heard() == StopGeneration(generation=0)


def test_a_dropped_agent_connection_is_a_node_loss_that_fails_the_run(job):
    job.agent.sock.close()
    got: list = []
    while not got:
        got = job.server.poll(timeout=5)
    (drop,) = got
    assert isinstance(drop, Dropped) and drop.node == 0 and "closed" in drop.reason
    job.core.node_lost(drop.node, drop.reason)
    (rec,) = job.records("node_lost")
    assert rec["node"] == 0 and rec["reason"] == "agent connection closed"
    assert rec["detection"] == "fail_stop" and rec["cause"] == "node_lost"
    assert job.core.fsm.state is RecoveryState.FAILED


def test_finishing_shuts_the_node_down(job):
    for rank in (0, 1):
        job.tell(RankExited(rank=rank, generation=0, returncode=0, t=1.0))
    assert job.core.fsm.state is RecoveryState.DONE
    assert job.heard() == Shutdown(generation=0)  # the generation it ended in


def test_a_second_agent_for_the_same_node_is_refused(job, tmp_path):
    sock = socket.create_connection(("127.0.0.1", job.server.port))
    intruder = Channel(sock, job.server.secret, FROM_COORDINATOR)
    intruder.send(Hello(node=0, pid=1))
    got: list = []
    while not got:
        got = job.server.poll(timeout=5)
    (drop,) = got
    assert isinstance(drop, Dropped) and "a second agent for node 0" in drop.reason
    assert job.server.nodes == {0}  # the first agent keeps its node


def test_a_forged_failure_report_is_rejected_and_never_acted_on(job):
    """A frame signed with another key claims a rank died: the channel rejects it before it is
    parsed, the connection is dropped (the node is lost), and no failure is logged."""
    forger = Channel(job.agent.sock, b"not the job secret", FROM_COORDINATOR)
    forger._send_seq = 10  # past the agent's own sequence numbers
    forger.send(RankExited(rank=1, generation=0, returncode=-9, t=5.0))
    got: list = []
    while not got:
        got = job.server.poll(timeout=5)
    (drop,) = got
    assert isinstance(drop, Dropped) and drop.reason == "authentication failed (bad HMAC tag)"
    assert job.records("failure_detected") == []
    assert job.core.fsm.state is RecoveryState.RUNNING  # nothing acted on the forged report


def test_a_fail_slow_report_reaches_the_sink_and_the_event_log(job, tmp_path):
    """Timings of a job whose rank 1 computes 2.2x slower from iteration 30 on, written where
    trainers write them: the monitor's polling feeds its fail-slow watch, whose report reaches
    the core as a FAIL_SLOW detection and the event log as `fail_slow`. A fail-slow report
    stops nothing."""
    from ..detect.synth import series

    seen: list[DetectionEvent] = []
    emit = job.core.emit
    job.core.emit = lambda e, **kw: (seen.append(e), emit(e, **kw))  # type: ignore[method-assign]
    metrics = JsonlLog(tmp_path / "metrics.jsonl", run="train")
    timings = JsonlLog(tmp_path / "timings.jsonl", run="train")
    for obs in series(slow_rank=1, slow_iter=30, factor=2.22, seed=1):
        for r, timing in obs.ranks.items():
            timings.write({**timing.to_dict(), "doc_lengths": obs.doc_lengths[r]})
        metrics.write(
            {"iter": obs.iteration, "iter_s": obs.seconds, "loss": 1.0, "tokens_per_s": 1.0,
             "state_hash": None, "generation": 0, "t_start": 0.0}
        )  # fmt: skip
    metrics.close()
    timings.close()
    job.monitor.poll()
    (event,) = seen
    assert (event.kind, event.rank, event.cause) == (DetectionKind.FAIL_SLOW, 1, "compute")
    assert 30 <= event.detected_at <= 33 and event.factor == pytest.approx(2.22, rel=0.1)
    (rec,) = job.records("fail_slow")
    assert (rec["rank"], rec["since_iter"], rec["detected_at"]) == (
        1,
        event.iteration,
        event.detected_at,
    )
    assert job.core.fsm.state is RecoveryState.RUNNING
