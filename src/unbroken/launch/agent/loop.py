"""The agent's event loop: what arrives (coordinator commands, heartbeats, reclamation requests,
the memory budget's OOM notification) goes to its owner; every tick (`TICK_S`) the trainers are
checked for an exit or a hang, pending shadows are spawned, memory is sampled, and the node's
beat goes to the coordinator. Only decisions leave the node (`RankExited`, `RankHung`), never
raw heartbeats. The agent never touches training state.

    coordinator --StartGeneration/StopGeneration/Shutdown--> Agent --Hello/NodeBeat/Started/
        RankExited/RankHung/Stopped/MemoryReport--> coordinator  (authenticated Channel)
    trainers/shadows --RankBeat--> heartbeat socket, --ReclaimRequest--> reclamation socket
    Agent --ReclaimAnswer--> the requesting trainer, --Promote--> a shadow's stdin

The loop owns the generation's trainers (rank -> `RankProc`); the `ProcessSupervisor` spawns,
kills and reaps processes, the `HangDetector` judges silent trainers, the `ShadowPool` holds the
next generation's shadows, and the `Reclaimer` frees the shadows' memory when training needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from unbroken.launch.agent.hang import CpuSample, HangDetector, Verdict, proc_cpu_sample
from unbroken.launch.agent.health import DeviceHealth
from unbroken.launch.agent.procs import RankProc
from unbroken.launch.agent.reclaim import Reclaimer
from unbroken.launch.agent.shadows import ShadowPool
from unbroken.launch.agent.supervisor import ProcessSupervisor
from unbroken.launch.protocol import FROM_COORDINATOR, Channel, ProtocolError
from unbroken.messages import (
    Hello,
    MemoryReport,
    Message,
    MessageError,
    NodeBeat,
    RankBeat,
    RankExited,
    RankHung,
    ReclaimRequest,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
    decode_json,
    encode_json,
)

__all__ = ["TICK_S", "Agent", "datagram_socket", "main"]

TICK_S = 0.02
"""The loop's period for what has no file descriptor to wait on (hang verdicts, shadows to
spawn, the memory sample, the node's beat). A trainer's exit wakes the loop at once: each
trainer's pidfd is in the selector (`_watch_exits`). Measured on the 2-core VM: a 5 ms poll
cost each agent ~0.05 of a core, which its node's trainers did not get."""


class Agent:
    """One node's agent.

    Args:
        channel: the authenticated connection to the coordinator.
        node: this node's id.
        heartbeats: the bound heartbeat socket (`RankBeat` datagrams), non-blocking.
        reclaims: the bound reclamation socket (`ReclaimRequest` datagrams), non-blocking.
        supervisor: spawns the node's processes (its addresses are those of the sockets).
        probe: pid -> CPU sample, for the hang detector (default: /proc).
    """

    def __init__(
        self,
        channel: Channel,
        node: int,
        heartbeats: socket.socket,
        reclaims: socket.socket,
        supervisor: ProcessSupervisor,
        probe: Callable[[int], CpuSample] = proc_cpu_sample,
    ) -> None:
        self.channel = channel
        self.node = node
        self.hb = heartbeats
        self.rc = reclaims
        self.supervisor = supervisor
        self.pool = ShadowPool(supervisor)
        self.reclaimer = Reclaimer(self.pool, self._report_memory)
        self.hangs = HangDetector(probe=probe)
        self.health = DeviceHealth()
        self.trainers: dict[int, RankProc] = {}
        """The current generation's trainers, by rank."""
        self.node_beat_s = 0.5
        self._last_node_beat = 0.0
        self._last_start: StartGeneration | None = None
        self.generation = -1
        """The newest generation started here (-1: none); said in every node message."""
        self.running = True
        """False after the coordinator's `Shutdown`."""
        self.heard = False
        """A command came from the coordinator (it accepted this node)."""
        self.fenced = ""
        """Why the coordinator refused this node (it was declared lost earlier)."""
        self.sel = selectors.DefaultSelector()
        self._pidfds: dict[int, int] = {}
        """pid -> the pidfd in the selector of each trainer not yet reported."""

    # -- commands -------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        match msg:
            case StartGeneration():
                self.start(msg)
            case StopGeneration():
                self.stop(msg)
            case Shutdown():
                self.shutdown_all()
                self.running = False
                self.fenced = msg.fenced
                if msg.fenced:
                    self.fenced += f" (the job is at generation {msg.generation})"

    def start(self, msg: StartGeneration) -> None:
        """Start a generation: promote its shadows when every rank has a live one (no process
        start, no rendezvous), else spawn trainers; with `regroup` (another node starts fresh
        trainers) or a changed world, each parked shadow regroups with the generation's world
        and the other ranks start fresh; then pre-initialize the next shadows."""
        self.hangs = dataclasses.replace(self.hangs, timeout_s=msg.heartbeat_timeout_s)
        self.node_beat_s = msg.node_heartbeat_s
        self.generation = max(self.generation, msg.generation)
        self.health.configure(msg)
        if self._refuse(msg):
            return
        if msg.state_managers:
            self.supervisor.ensure_state_managers(msg.state_managers)
        self._setup_memory(msg)
        self._last_start = msg
        gen, ranks = msg.generation, msg.ranks
        if msg.world_changed or msg.regroup:
            # `regroup`: another node starts fresh trainers; parked shadows meet them in the
            # generation's own group, the others are replaced (as in a changed world).
            promoted = self._promote_into_new_world(msg)
            ready = 0
        else:
            promoted = self.pool.alive_for(gen, ranks)
            ready = self.pool.ready_count(ranks) if promoted else 0
            if promoted:
                for r in ranks:
                    self.trainers[r] = self.pool.promote(r, msg.spec, time.time())
            else:
                self.pool.reclaim()
                for r in ranks:
                    self.trainers[r] = self.supervisor.spawn(msg, r, gen, msg.spec)
        level = self.reclaimer.level_at_recovery(msg, len(ranks))
        launched = self.pool.prepare(msg, level)
        self.channel.send(
            Started(
                generation=gen,
                t=time.time(),
                promoted=promoted,
                shadows_ready=ready,
                shadows=launched,
            )
        )

    def _promote_into_new_world(self, msg: StartGeneration) -> bool:
        """The world changed (devices lost or back), or another node starts fresh trainers
        (`regroup`): each rank whose device has a live shadow
        gets it, under its new rank number, regrouping with the new world (its imports, device
        runtime and warm-up are kept); the others start fresh — forked from the node's fork
        server (its imports done) when the job runs shadows. Returns whether any shadow was
        promoted."""
        shadow_of = self.pool.by_device(msg.generation)
        mine = {r: shadow_of.get(msg.devices.get(str(r), r)) for r in msg.ranks}
        for r, old in mine.items():
            if old is not None:
                self.trainers[r] = self.pool.promote(old, msg.spec, time.time(), as_rank=r)
        self.pool.reclaim()  # the shadows of devices no longer in the world
        for r, old in mine.items():
            if old is None:  # a device back in the world (re-admitted): from the fork server
                self.trainers[r] = self.supervisor.spawn(
                    msg, r, msg.generation, msg.spec, fork=msg.shadows is not None
                )
        return any(old is not None for old in mine.values())

    def _refuse(self, msg: StartGeneration) -> bool:
        """Start nothing of a generation that would put a rank on a lost device; each such rank
        is reported as exited with its device lost (the coordinator re-plans without it)."""
        refused = self.health.refused(msg.ranks)
        for rank, reason in refused:
            self.channel.send(
                RankExited(
                    rank=rank,
                    generation=msg.generation,
                    returncode=1,
                    t=time.time(),
                    said=f"refused to start rank {rank}: {reason}",
                    device_lost=reason,
                )
            )
        return bool(refused)

    def _setup_memory(self, msg: StartGeneration) -> None:
        budget = self.reclaimer.setup(msg)
        if budget is None:
            return
        self.supervisor.cgroup_procs = budget.procs_file
        if budget.eventfd is not None:
            self.sel.register(budget.eventfd, selectors.EVENT_READ, "oom")

    def stop(self, msg: StopGeneration) -> None:
        t0 = time.time()
        self.kill_trainers()
        self.channel.send(
            Stopped(generation=msg.generation, t=time.time(), took_s=time.time() - t0)
        )

    def kill_trainers(self) -> None:
        """SIGKILL every trainer (stopped ones too) and reap them. State managers stay."""
        self.supervisor.kill(t.proc for t in self.trainers.values())
        self.trainers.clear()

    def shutdown_all(self) -> None:
        """Every child gone, then the memory cgroup removed."""
        self.kill_trainers()
        self.pool.reclaim()
        self.supervisor.kill_state_managers()
        self.reclaimer.close()

    # -- what the node's processes send -----------------------------------------------------------
    def on_beat(self, beat: RankBeat) -> None:
        """A heartbeat: it belongs to the rank's trainer of its generation, else to its shadow
        — the process that sent it (a shadow promoted under another rank may still have sent
        one beat under its old rank)."""
        t = self.trainers.get(beat.rank)
        if t is None or beat.generation != t.generation or beat.pid != t.proc.pid:
            t = self.pool.find(beat.rank)
        if t is not None and beat.generation == t.generation and beat.pid == t.proc.pid:
            t.beat = beat
            t.liveness = t.liveness.beat(time.time(), beat.status)
        self.pool.on_beat(beat, self.trainers.keys())
        self.pool.tell(self.trainers)

    def on_reclaim_request(self, req: ReclaimRequest) -> None:
        answer = self.reclaimer.on_request(req, self.trainers.keys())
        # A trainer that died meanwhile needs no answer; a reply address that is no socket
        # name (it cannot be encoded) gets none either — the datagram was not a trainer's.
        with contextlib.suppress(OSError, UnicodeError, ValueError):
            self.rc.sendto(encode_json(answer), req.reply.replace("@", "\0", 1))

    # -- supervision ----------------------------------------------------------------------
    def check_children(self) -> None:
        """Report every trainer that exited or hung since the last tick (once each)."""
        now = time.time()
        for t in self.trainers.values():
            if t.reported:
                continue
            code = t.proc.poll()
            if code is not None:
                t.reported = True
                if all(x.reported for x in self.trainers.values()):
                    # The generation is over. The report goes before the last exit: on that
                    # one the coordinator may shut down and read nothing more.
                    self.reclaimer.generation_over()
                self.channel.send(self._exited(t, code, now))
                continue
            judged = self.hangs.assess(t.liveness, t.proc.pid, now)
            t.liveness = judged.liveness
            if judged.verdict is Verdict.HUNG:
                t.reported = True
                self.channel.send(self._hung(t, judged.silent_s, now))

    def _exited(self, t: RankProc, code: int, now: float) -> RankExited:
        debug = self._last_start is not None and self._last_start.debug
        lost = self.health.check(t.rank) if code != 0 else ""
        if lost:  # its memory went with it: nothing may keep serving it
            self.supervisor.stop_state_manager(self.health.device_of(t.rank))
        return RankExited(
            rank=t.rank,
            generation=t.generation,
            returncode=code,
            t=now,
            said=t.last_words() if code > 0 else "",
            completed=t.completed,
            iteration=t.beat.iteration if t.beat else -1,
            phase=t.beat.phase if t.beat else "",
            traceback=t.traceback() if code > 0 and debug else "",
            device_lost=lost,
        )

    @staticmethod
    def _hung(t: RankProc, silent_s: float, now: float) -> RankHung:
        return RankHung(
            rank=t.rank,
            generation=t.generation,
            silent_s=silent_s,
            t=now,
            phase=t.beat.phase if t.beat else "",
            iteration=t.beat.iteration if t.beat else -1,
            completed=t.completed,
        )

    def _watch_exits(self) -> None:
        """Keep a pidfd in the selector for every trainer not yet reported (its exit makes it
        readable, so the loop wakes at once), and drop those of the others."""
        live = {t.proc.pid for t in self.trainers.values() if not t.reported}
        for pid in [p for p in self._pidfds if p not in live]:
            fd = self._pidfds.pop(pid)
            self.sel.unregister(fd)
            os.close(fd)
        for pid in live - self._pidfds.keys():
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone (the tick's poll sees it) or no pidfd support
                continue
            self._pidfds[pid] = fd
            self.sel.register(fd, selectors.EVENT_READ, "exit")

    def tick(self) -> None:
        # Beats that arrived since the select first: a rank that beat and then exited within
        # this tick is reported with the iteration and phase it was in.
        for beat in _datagrams(self.hb, RankBeat):
            self.on_beat(beat)
        self.check_children()
        self._watch_exits()
        self.pool.spawn_pending()
        if self.running:
            self.reclaimer.sample()
        now = time.time()
        if now - self._last_node_beat >= self.node_beat_s:
            # The node's liveness for the coordinator: a decision-free beat, one per interval
            # (raw trainer heartbeats never leave the node).
            self._last_node_beat = now
            beat = NodeBeat(
                t=now,
                trainers=len(self.trainers),
                generation=self.generation,
                shadows_for=self._shadows_for(),
            )
            self.channel.send(beat)

    def _shadows_for(self) -> int:
        """The generation every local rank has a live shadow for (-1: none; `NodeBeat`)."""
        start = self._last_start
        if start is None or not start.ranks:
            return -1
        nxt = start.generation + 1
        return nxt if self.pool.alive_for(nxt, start.ranks) else -1

    def _report_memory(self, msg: MemoryReport) -> None:
        self.channel.send(dataclasses.replace(msg, generation=self.generation))

    def serve(self) -> None:
        """Run until a `Shutdown` or the coordinator is gone (then nothing may run
        unsupervised: every child is killed)."""
        sel = self.sel
        sel.register(self.channel.sock, selectors.EVENT_READ, "ctl")
        sel.register(self.hb, selectors.EVENT_READ, "hb")
        sel.register(self.rc, selectors.EVENT_READ, "rc")
        for msg in self.channel.take_pending():
            self.heard = True
            self.handle(msg)
        while self.running:
            for key, _ in sel.select(timeout=TICK_S):
                if not self._on_ready(key.data):
                    self.shutdown_all()
                    return
            self.tick()

    def _on_ready(self, what: str) -> bool:
        """Handle what is readable; False when the coordinator closed the connection."""
        if what == "hb":
            for beat in _datagrams(self.hb, RankBeat):
                self.on_beat(beat)
        elif what == "rc":
            for req in _datagrams(self.rc, ReclaimRequest):
                self.on_reclaim_request(req)
        elif what == "oom":
            self.reclaimer.on_oom(self.trainers.keys())
        elif what == "exit":
            pass  # a trainer exited: the tick that follows reports it
        else:
            data = self.channel.sock.recv(65536)
            if not data:
                return False
            for msg in self.channel.feed(data):
                self.heard = True
                self.handle(msg)
        return True


M = TypeVar("M", bound=Message)


def _datagrams(sock: socket.socket, kind: type[M]) -> Iterator[M]:
    """The messages of type `kind` waiting on `sock`; a garbled datagram is ignored, never
    fatal."""
    while True:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        try:
            msg = decode_json(data, (kind,))
        except MessageError:
            continue
        assert isinstance(msg, kind)
        yield msg


def datagram_socket(kind: str) -> tuple[socket.socket, str]:
    """A non-blocking Unix datagram socket at a fresh abstract address ("@..." form)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = f"\0unbroken-{kind}-{os.getpid()}-{os.urandom(4).hex()}"
    sock.bind(addr)
    sock.setblocking(False)
    return sock, addr.replace("\0", "@")


def main(argv: list[str] | None = None) -> int:
    """`python -m unbroken.launch.agent --coordinator HOST:PORT --node N [--local-addr A]
    [--secret-file F]`, the job secret in the file or in UNBROKEN_JOB_SECRET. Exit status: 0
    after the coordinator's `Shutdown`, 1 when cut off from it, 2 for a bad invocation."""
    parser = argparse.ArgumentParser(prog="unbroken-agent")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--node", type=int, default=0)
    parser.add_argument("--local-addr", help="this node's address (the connection's source)")
    parser.add_argument("--secret-file", help="the job secret (a file of mode 0600)")
    parser.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to retry connecting"
    )
    args = parser.parse_args(argv)
    return serve_node(
        args.coordinator, args.node, args.local_addr, args.secret_file, args.connect_timeout
    )


def serve_node(
    coordinator: str,
    node: int,
    local_addr: str | None = None,
    secret_file: str | None = None,
    connect_timeout_s: float = 60.0,
) -> int:
    """Join the job at `coordinator` ("HOST:PORT") as `node` and serve it until it ends (see
    `main` for the exit status); every failure is one line on stderr."""
    from unbroken.errors import UserError
    from unbroken.launch.agent.join import connect
    from unbroken.launch.rendezvous import SECRET_ENV, load_secret, secret_key

    who = f"unbroken: node {node}"
    # The node's processes inherit it: a `nodeloss` fault takes the node down through it.
    os.environ["UNBROKEN_AGENT_PID"] = str(os.getpid())
    try:
        text = load_secret(secret_file, os.environ)
    except UserError as exc:
        print(f"{who}: {exc}", file=sys.stderr)
        return 2
    if not text:
        print(f"{who}: no job secret (--secret-file, or {SECRET_ENV})", file=sys.stderr)
        return 2
    host, _, port = coordinator.rpartition(":")
    try:
        sock = connect(host.strip("[]"), int(port), connect_timeout_s, local_addr)
    except OSError as exc:
        print(f"{who}: cannot reach the coordinator at {coordinator}: {exc}", file=sys.stderr)
        return 1
    channel = Channel(sock, secret_key(text), FROM_COORDINATOR)
    hb, hb_addr = datagram_socket("hb")
    rc, rc_addr = datagram_socket("reclaim")
    me = local_addr or socket.gethostname()
    channel.send(Hello(node=node, pid=os.getpid(), host=me))
    agent = Agent(channel, node, hb, rc, ProcessSupervisor(hb_addr, rc_addr))
    try:
        agent.serve()
    except ProtocolError as exc:
        print(f"{who}: rejected a control message: {exc}", file=sys.stderr)
        agent.shutdown_all()
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"{who}: lost the coordinator: {exc}", file=sys.stderr)
        agent.shutdown_all()
        return 1
    return _farewell(agent, who, coordinator)


def _farewell(agent: Agent, who: str, coordinator: str) -> int:
    """How the node's service ended: 0 after the job's `Shutdown`, else 1 and why."""
    if agent.fenced:
        why = f"{agent.fenced}; every process of this node is stopped"
        print(f"{who}: cut off by the coordinator at {coordinator}: {why}", file=sys.stderr)
        return 1
    if not agent.running:
        return 0
    # The coordinator closed the connection without a Shutdown.
    if not agent.heard:
        print(
            f"{who}: the coordinator at {coordinator} closed the connection before accepting "
            "this node: is the job secret the same on every node? (node 0's events.jsonl says "
            "why: control_rejected)",
            file=sys.stderr,
        )
    else:
        print(
            f"{who}: cut off by the coordinator at {coordinator} (this node was declared lost, "
            "or the job ended); every process of this node is stopped",
            file=sys.stderr,
        )
    return 1
