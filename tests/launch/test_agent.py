"""The node agent as a whole: a real `Agent` driven through a real authenticated `Channel` over a
socketpair by a fake coordinator, supervising harmless stand-in trainers (fake_trainer.py) that
send real `RankBeat` datagrams. What comes out is typed and correct — exits with their status,
last words and progress, hangs of a stopped and of an asleep rank, promotion of ready shadows,
reclamation on an allocation failure — and no child is left behind after `Shutdown`.

Waiting is on conditions (a message, the agent's view of a beat), never on a sleep; the
heartbeat timeout is generous so a loaded machine does not make a beating child look hung."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from unbroken.launch.agent import Agent
from unbroken.launch.agent.loop import datagram_socket
from unbroken.launch.agent.supervisor import ProcessSupervisor
from unbroken.launch.protocol import FROM_AGENT, FROM_COORDINATOR, Channel
from unbroken.messages import (
    MemoryReport,
    Message,
    NodeBeat,
    RankExited,
    RankHung,
    RankStatus,
    ReclaimRequest,
    ShadowLaunch,
    ShadowPlan,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
    encode_json,
)

FAKE_TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
WAIT_S = 120.0
HEARTBEAT_TIMEOUT_S = 3.0


class FakeCoordinator:
    """The coordinator's end of the channel: sends commands, waits for typed messages."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.backlog: list[Message] = []
        self.node_beats = 0
        self.beat_generations: set[int] = set()
        """The generations the node's beats said it runs."""
        self.beat_shadows: set[int] = set()
        """The generations the node's beats said every rank had a live shadow for."""

    def send(self, msg: Message) -> None:
        self.channel.send(msg)

    def expect(self, kind: type[Message], **fields) -> Message:
        """The first message of `kind` with these field values (others are kept)."""

        def wanted(m: Message) -> bool:
            return isinstance(m, kind) and all(getattr(m, k) == v for k, v in fields.items())

        deadline = time.monotonic() + WAIT_S
        while True:
            for i, msg in enumerate(self.backlog):
                if wanted(msg):
                    return self.backlog.pop(i)
            left = deadline - time.monotonic()
            assert left > 0, f"no {kind.__name__} {fields} from the agent; got {self.backlog}"
            msg = self.channel.recv_blocking(timeout=left)
            if isinstance(msg, NodeBeat):
                self.node_beats += 1
                self.beat_generations.add(msg.generation)
                self.beat_shadows.add(msg.shadows_for)
            else:
                self.backlog.append(msg)

    def beat_with_shadows_for(self, generation: int) -> None:
        """Read on until a node beat says every rank has a live shadow for `generation`."""
        deadline = time.monotonic() + WAIT_S
        while generation not in self.beat_shadows:
            left = deadline - time.monotonic()
            assert left > 0, f"no beat with shadows for {generation}: {self.beat_shadows}"
            msg = self.channel.recv_blocking(timeout=left)
            if isinstance(msg, NodeBeat):
                self.beat_shadows.add(msg.shadows_for)
            else:
                self.backlog.append(msg)


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # polling the agent's state, not a sync by sleep
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        a, b = socket.socketpair()
        secret = os.urandom(32)
        self.coordinator = FakeCoordinator(Channel(b, secret, FROM_AGENT))
        hb, hb_addr = datagram_socket("hb")
        rc, rc_addr = datagram_socket("reclaim")
        supervisor = ProcessSupervisor(hb_addr, rc_addr, trainer_cmd=(sys.executable, FAKE_TRAINER))
        self.agent = Agent(Channel(a, secret, FROM_COORDINATOR), 0, hb, rc, supervisor)
        self.thread = threading.Thread(target=self.agent.serve, name="agent", daemon=True)
        self.thread.start()

    def spec(self, generation: int, ranks: dict[int, dict]) -> str:
        path = self.dir / f"gen{generation}.json"
        path.write_text(json.dumps({"generation": generation, "ranks": ranks}))
        return str(path)

    def start(self, generation: int, spec: str, ranks: list[int], **kw) -> Started:
        self.coordinator.send(
            StartGeneration(
                generation=generation,
                spec=spec,
                ranks=ranks,
                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                node_heartbeat_s=0.2,
                log_dir=str(self.dir / "logs"),
                **kw,
            )
        )
        started = self.coordinator.expect(Started, generation=generation)
        assert isinstance(started, Started)
        return started

    def seen_beat(self, rank: int, status: RankStatus, shadow: bool = False) -> bool:
        procs = self.agent.pool.shadows if shadow else self.agent.trainers
        t = procs.get(rank)
        return t is not None and t.beat is not None and t.beat.status is status

    def go(self, rank: int) -> None:
        """Let a rank waiting on "go" proceed, once the agent has seen it training."""
        _wait_until(lambda: self.seen_beat(rank, RankStatus.TRAINING), f"rank {rank} beat")
        beat = self.agent.trainers[rank].beat
        assert beat is not None
        os.kill(beat.pid, signal.SIGUSR1)

    def shutdown(self) -> list[int]:
        """Shut the agent down; the pids of every process it ever started."""
        self.coordinator.send(Shutdown())
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        return [int(p.name) for p in (self.dir / "pids").iterdir()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    if n.thread.is_alive():  # a failed test: take its children down with it
        n.coordinator.send(Shutdown())
        n.thread.join(WAIT_S)


def test_exits_and_hangs_are_reported_typed_and_nothing_outlives_shutdown(node):
    spec = node.spec(
        0,
        {
            0: {"iteration": 7, "go": True, "exit": 0},
            1: {"iteration": 4, "go": True, "say": "boom: the disk is full", "exit": 3},
            2: {"iteration": 5, "then": "stop"},
            3: {"iteration": 6, "then": "sleep"},
        },
    )
    started = node.start(0, spec, [0, 1, 2, 3])
    assert started == Started(
        generation=0, t=started.t, promoted=False, shadows_ready=0, shadows=None
    )
    node.go(0)
    node.go(1)
    coord = node.coordinator
    ok = coord.expect(RankExited, rank=0)
    assert (ok.generation, ok.returncode, ok.said, ok.traceback) == (0, 0, "", "")
    assert (ok.iteration, ok.completed, ok.phase) == (7, 6, "compute")
    bad = coord.expect(RankExited, rank=1)
    assert (bad.returncode, bad.said, bad.iteration, bad.completed) == (
        3,
        "boom: the disk is full",
        4,
        3,
    )
    stopped = coord.expect(RankHung, rank=2)
    asleep = coord.expect(RankHung, rank=3)
    for hung, iteration in ((stopped, 5), (asleep, 6)):
        assert (hung.generation, hung.iteration, hung.completed, hung.phase) == (
            0,
            iteration,
            iteration - 1,
            "compute",
        )
        assert hung.silent_s > HEARTBEAT_TIMEOUT_S
    coord.send(StopGeneration(generation=0))
    done = coord.expect(Stopped, generation=0)
    assert done.took_s >= 0
    assert coord.node_beats > 0 and coord.beat_generations <= {-1, 0}
    assert 0 in coord.beat_generations, "the node's beats say the generation it runs"
    assert not [m for m in coord.backlog if isinstance(m, RankExited | RankHung)]
    pids = node.shutdown()
    assert len(pids) == 4 and all(_gone(p) for p in pids)


def test_a_running_trainer_wakes_the_loop_through_its_pidfd(node):
    """The loop waits on each unreported trainer's pidfd, so an exit is seen when it happens,
    not at the next tick; the pidfd is closed once the exit is reported."""
    spec = node.spec(0, {0: {"iteration": 3, "go": True, "exit": 0}})
    node.start(0, spec, [0])
    _wait_until(lambda: node.seen_beat(0, RankStatus.TRAINING), "rank 0 beat")
    pid = node.agent.trainers[0].proc.pid
    _wait_until(lambda: pid in node.agent._pidfds, "rank 0's pidfd in the selector")
    assert node.agent.sel.get_key(node.agent._pidfds[pid]).data == "exit"
    node.go(0)
    node.coordinator.expect(RankExited, rank=0)
    _wait_until(lambda: pid not in node.agent._pidfds, "its pidfd closed")
    node.shutdown()


def test_ready_shadows_are_promoted_into_the_next_generation(node):
    spec1 = node.spec(1, {0: {"exit": 5}, 1: {"exit": 6}})
    spec0 = node.spec(0, {0: {"then": "run"}, 1: {"then": "run"}})
    plan = ShadowPlan(level=2, start="exec", next_spec=spec1)
    started = node.start(0, spec0, [0, 1], shadows=plan)
    assert started.shadows == ShadowLaunch(level=2, generation=1, start="exec")
    for r in (0, 1):
        _wait_until(lambda r=r: node.seen_beat(r, RankStatus.SHADOW_READY, shadow=True), "ready")
    coord = node.coordinator
    coord.send(StopGeneration(generation=0))
    coord.expect(Stopped, generation=0)
    promoted = node.start(1, spec1, [0, 1])
    assert (promoted.promoted, promoted.shadows_ready, promoted.shadows) == (True, 2, None)
    for rank, code in ((0, 5), (1, 6)):
        exited = coord.expect(RankExited, rank=rank)
        assert (exited.generation, exited.returncode) == (1, code)
    pids = node.shutdown()
    assert len(pids) == 4 and all(_gone(p) for p in pids)


def test_live_shadows_are_reported_and_regroup_when_the_coordinator_says_so(node):
    # The node's beat says its ranks have live shadows for generation 1; with `regroup`
    # (another node starts fresh trainers) its parked shadows are still promoted — under their
    # own ranks, to meet the fresh ones in the generation's own group: no new process.
    spec1 = node.spec(1, {0: {"exit": 5}, 1: {"exit": 6}})
    spec0 = node.spec(0, {0: {"then": "run"}, 1: {"then": "run"}})
    plan = ShadowPlan(level=2, start="exec", next_spec=spec1)
    node.start(0, spec0, [0, 1], shadows=plan)
    coord = node.coordinator
    coord.beat_with_shadows_for(1)
    for r in (0, 1):
        _wait_until(lambda r=r: node.seen_beat(r, RankStatus.SHADOW_READY, shadow=True), "ready")
    coord.send(StopGeneration(generation=0))
    coord.expect(Stopped, generation=0)
    started = node.start(1, spec1, [0, 1], regroup=True)
    assert started.promoted is True
    for rank, code in ((0, 5), (1, 6)):
        exited = coord.expect(RankExited, rank=rank)
        assert (exited.generation, exited.returncode) == (1, code)
    pids = node.shutdown()
    assert len(pids) == 4 and all(_gone(p) for p in pids)  # 2 trainers, 2 shadows promoted


def test_an_allocation_failure_reclaims_the_shadows_and_relaunches_them(node):
    spec1 = node.spec(1, {0: {}, 1: {}})
    spec0 = node.spec(0, {0: {"go": True, "then": "reclaim"}, 1: {"then": "run"}})
    plan = ShadowPlan(level=2, start="exec", next_spec=spec1)
    node.start(0, spec0, [0, 1], shadows=plan)
    for r in (0, 1):
        _wait_until(lambda r=r: node.seen_beat(r, RankStatus.SHADOW_READY, shadow=True), "ready")
    first = {t.proc.pid for t in node.agent.pool.shadows.values()}
    node.go(0)
    coord = node.coordinator
    exited = coord.expect(RankExited, rank=0)
    assert exited.returncode == 12  # the answer said: 2 shadows reclaimed
    report = coord.expect(MemoryReport, event="shadows_reclaimed")
    assert report.generation == 0  # the generation the node ran when it reclaimed
    assert (report.fields["shadows"], report.fields["level_from"], report.fields["level_to"]) == (
        2,
        2,
        2,
    )
    assert all(_gone(p) for p in first)  # reclaimed means gone, not signalled
    # No iteration to get past: the same generation's shadows come back at once.
    pool = node.agent.pool
    _wait_until(lambda: pool.attempt == 2 and len(pool.shadows) == 2, "shadows relaunched")
    relaunched = {t.proc.pid for t in list(pool.shadows.values())}
    assert len(relaunched) == 2 and not relaunched & first
    assert {t.generation for t in list(pool.shadows.values())} == {1}
    pids = node.shutdown()
    assert len(pids) >= 4 and all(_gone(p) for p in pids)


def test_hostile_datagrams_do_not_take_the_agent_down(node):
    """Any process in the network namespace can reach the agent's abstract sockets
    (docs/security.md): nested-too-deep JSON and a reply address no socket can have are
    ignored, and the agent still serves its coordinator."""
    sup = node.agent.supervisor
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for addr in (sup.heartbeat_addr, sup.reclaim_addr):
        out.sendto(b"[" * 100_000, addr.replace("@", "\0", 1))
    bad_reply = ReclaimRequest(rank=0, generation=0, reply="@\ud800", reason="x", t=time.time())
    out.sendto(encode_json(bad_reply), sup.reclaim_addr.replace("@", "\0", 1))
    # A generation started after them proves the loop went past both datagrams.
    spec = node.spec(0, {0: {"exit": 3}})
    node.start(0, spec, [0])
    node.coordinator.expect(RankExited, rank=0, returncode=3)
    assert node.thread.is_alive()
    node.shutdown()
