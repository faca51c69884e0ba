"""Fail-stop decisions reach recovery through the detectors' one interface: the coordinator
turns an agent's rank_exit / rank_hung and its own node-loss decisions into
`DetectionEvent(kind=FAIL_STOP)`, logs them (the event-log records keep their fields) and hands
them to `RecoveryMachine.on_detection`; the fail-slow watch's reports reach the same sink.

No agent process: the test plays the agent at the far end of a real authenticated control
channel (a socketpair, `Channel` at both ends, the job's secret), so every report crosses the
framing, HMAC and sequence checks the agent's would."""

from __future__ import annotations

import os
import selectors
import socket
import time
import types

import pytest

from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.launch.coordinator import Coordinator, _Conn
from unbroken.launch.protocol import COORDINATOR_OPS, Channel
from unbroken.metrics.log import JsonlLog, read_jsonl
from unbroken.recovery import RecoveryMachine, RecoveryState

from ..foundation.conftest import tiny_job


def _stop(cause: FailStopCause, **kw) -> DetectionEvent:
    return DetectionEvent(kind=DetectionKind.FAIL_STOP, cause=cause, **kw)


def _running() -> RecoveryMachine:
    fsm = RecoveryMachine(world_size=2, max_restarts=3, mode="inplace")
    fsm.begin()
    fsm.on_started(0)
    return fsm


def test_fsm_acts_on_fail_stop_events_by_cause():
    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.EXIT, rank=1, generation=0, returncode=-9))
    assert act.op == "stop" and fsm.state is RecoveryState.STOPPING
    assert "rank 1 exited with status -9" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.HANG, rank=0, generation=0, silent_s=1.6))
    assert act.op == "stop" and "hung (no heartbeat for 1.60s)" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.NODE_LOST, rank=None, node=0, reason="closed"))
    assert act.op == "fail" and fsm.state is RecoveryState.FAILED


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


class Agent:
    """The agent's end of a real authenticated control channel (a socketpair): what the
    coordinator sends is received, verified and decoded by a `Channel` as the agent's is."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        self.channel = Channel(sock, secret, COORDINATOR_OPS)
        self.sent: list[str] = []

    def receive(self) -> list[str]:
        """Ops the coordinator has sent since the last call (its sends are complete frames in
        the socket buffer by the time they return)."""
        self.channel.sock.setblocking(False)
        try:
            while True:
                data = self.channel.sock.recv(65536)
                if not data:
                    break
                self.sent += [m["op"] for m in self.channel.feed(data)]
        except BlockingIOError:
            pass
        return self.sent


def deliver(coord: Coordinator) -> None:
    """The coordinator's loop, once: read what is waiting on its connections."""
    for key, _ in coord.sel.select(timeout=10):
        if key.data is not None:
            coord._read(key.data)


@pytest.fixture
def coordinator(tmp_path):
    coord = Coordinator(tiny_job(), tmp_path, quiet=True)
    coord.store = types.SimpleNamespace(port=0)  # only written into the generation spec
    coord._last_failure_t = 0.0
    coord._agent_seen = time.time()
    near, far = socket.socketpair()
    near.setblocking(False)
    coord.sel.register(near, selectors.EVENT_READ, _Conn(near, "socketpair", coord.secret))
    agent = Agent(far, coord.secret)
    agent.channel.send("hello", node=0, pid=os.getpid())
    deliver(coord)
    assert agent.receive() == ["start"]
    agent.channel.send("started", generation=0)
    deliver(coord)
    assert coord.fsm.state is RecoveryState.RUNNING
    yield coord, agent, tmp_path / "events.jsonl"
    far.close()
    coord.sel.close()
    coord.events.close()


def _records(path, kind):
    return [e for e in read_jsonl(path) if e["kind"] == kind]


def test_rank_exit_becomes_a_fail_stop_event_logged_and_acted_on(coordinator):
    coord, agent, log = coordinator
    seen: list[DetectionEvent] = []
    emit = coord.emit
    coord.emit = lambda e: (seen.append(e), emit(e))  # type: ignore[method-assign]
    agent.channel.send("rank_exit", rank=1, generation=0, returncode=-9, t=5.0, said="")
    deliver(coord)
    (event,) = seen
    assert (event.kind, event.cause, event.rank, event.returncode) == (
        DetectionKind.FAIL_STOP,
        FailStopCause.EXIT,
        1,
        -9,
    )
    (rec,) = _records(log, "failure_detected")
    assert rec["rank"] == 1 and rec["generation"] == 0 and rec["t_detected"] == 5.0
    assert rec["reason"] == "exited with status -9" and "detect_s" in rec
    assert rec["detection"] == "fail_stop" and rec["cause"] == "exit" and rec["returncode"] == -9
    assert coord.fsm.state is RecoveryState.STOPPING and agent.receive()[-1] == "stop"


def test_a_finished_rank_is_not_a_failure(coordinator):
    coord, agent, log = coordinator
    agent.channel.send("rank_exit", rank=0, generation=0, returncode=0, t=1.0)
    deliver(coord)
    assert _records(log, "failure_detected") == []
    assert coord.fsm.state is RecoveryState.RUNNING and coord.fsm.finished_ranks == {0}
    assert agent.receive() == ["start"]


def test_rank_hung_becomes_a_fail_stop_event(coordinator):
    coord, agent, log = coordinator
    agent.channel.send("rank_hung", rank=0, generation=0, silent_s=1.7, t=2.0)
    deliver(coord)
    (rec,) = _records(log, "failure_detected")
    assert (
        rec["cause"] == "hang" and rec["silent_s"] == 1.7 and rec["reason"] == "hung (silent 1.70s)"
    )
    assert coord.fsm.state is RecoveryState.STOPPING and agent.receive()[-1] == "stop"


def test_a_closed_agent_connection_is_a_node_loss_that_fails_the_run(coordinator):
    coord, agent, log = coordinator
    agent.channel.sock.close()
    deliver(coord)
    (rec,) = _records(log, "node_lost")
    assert rec["node"] == 0 and rec["reason"] == "agent connection closed"
    assert rec["detection"] == "fail_stop" and rec["cause"] == "node_lost"
    assert coord.fsm.state is RecoveryState.FAILED


def test_a_forged_failure_report_is_rejected_and_never_acted_on(coordinator):
    """A frame signed with another key claims a rank died: the channel rejects it before it is
    parsed, the connection is dropped (the node is lost), and no failure is logged."""
    coord, agent, log = coordinator
    forger = Channel(agent.channel.sock, b"not the job secret", COORDINATOR_OPS)
    forger._send_seq = 10  # past the agent's own sequence numbers
    forger.send("rank_exit", rank=1, generation=0, returncode=-9, t=5.0, said="")
    deliver(coord)
    (rejected,) = _records(log, "control_rejected")
    assert rejected["reason"] == "authentication failed (bad HMAC tag)"
    assert _records(log, "failure_detected") == []
    assert coord.fsm.state is RecoveryState.FAILED and agent.receive() == ["start"]


def test_node_loss_becomes_a_fail_stop_event_and_fails_the_run(coordinator):
    coord, agent, log = coordinator
    coord._node_lost("beats stopped (agent silent for 1.2s)", 1.2)
    (rec,) = _records(log, "node_lost")
    assert rec["node"] == 0 and "beats stopped" in rec["reason"] and rec["silent_s"] == 1.2
    assert rec["detection"] == "fail_stop" and rec["cause"] == "node_lost"
    assert coord.fsm.state is RecoveryState.FAILED
    assert agent.receive() == ["start"]  # nothing is sent to a lost agent


def test_a_fail_slow_report_reaches_the_sink_and_the_event_log(coordinator):
    """Timings of a job whose rank 1 computes 2.2x slower from iteration 30 on, written where
    trainers write them: the coordinator's own polling feeds its fail-slow watch, whose report
    reaches the coordinator as a FAIL_SLOW detection and the event log as `fail_slow`. A
    fail-slow report stops nothing."""
    from ..detect.synth import series

    coord, agent, log = coordinator
    seen: list[DetectionEvent] = []
    emit = coord.emit
    coord.emit = lambda e: (seen.append(e), emit(e))  # type: ignore[method-assign]
    metrics = JsonlLog(coord.run_dir / "metrics.jsonl", run=coord.run_name)
    timings = JsonlLog(coord.run_dir / "timings.jsonl", run=coord.run_name)
    for obs in series(slow_rank=1, slow_iter=30, factor=2.22, seed=1):
        for r, timing in obs.ranks.items():
            timings.write({**timing.to_dict(), "doc_lengths": obs.doc_lengths[r]})
        metrics.write(
            {"iter": obs.iteration, "iter_s": obs.seconds, "loss": 1.0, "tokens_per_s": 1.0,
             "state_hash": None, "generation": 0, "t_start": 0.0}
        )  # fmt: skip
    metrics.close()
    timings.close()
    coord._poll_metrics()
    (event,) = seen
    assert (event.kind, event.rank, event.cause) == (DetectionKind.FAIL_SLOW, 1, "compute")
    assert 30 <= event.detected_at <= 33 and event.factor == pytest.approx(2.22, rel=0.1)
    (rec,) = _records(log, "fail_slow")
    assert (rec["rank"], rec["since_iter"], rec["detected_at"]) == (
        1,
        event.iteration,
        event.detected_at,
    )
    assert coord.fsm.state is RecoveryState.RUNNING and agent.receive() == ["start"]
