"""The node agent: spawns and supervises this node's trainers, detects failures, executes the
coordinator's commands.

Detection: a child that exits is noticed at once (`Popen.poll` every tick, 5 ms); a child whose
heartbeats (datagrams on the agent's Unix socket, sent by a trainer thread every
`heartbeat_interval_s`) stop for `heartbeat_timeout_s` is declared hung (a SIGSTOPped or wedged
process sends nothing). Only decisions go to the coordinator (`rank_exit`, `rank_hung`), never raw
heartbeats. The agent never touches training state.

Run as `python -m unbroken.launch.agent --coordinator HOST:PORT --node N`, with the job secret
in the environment variable UNBROKEN_JOB_SECRET.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from unbroken.launch.protocol import FROM_COORDINATOR, Channel, ProtocolError
from unbroken.messages import (
    Hello,
    MemoryReport,
    MessageError,
    NodeBeat,
    Promote,
    RankBeat,
    RankExited,
    RankHung,
    RankStatus,
    ReclaimAnswer,
    ReclaimRequest,
    ShadowLaunch,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
    decode_json,
    encode_json,
)

__all__ = ["main"]

TICK_S = 0.005
PR_SET_PDEATHSIG = 1


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen between fork and exec


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the agent dies, so no trainer outlives its
    supervisor (children are spawned from the agent's main thread, so "parent" is the agent;
    the fork server's warm-up thread spawns nothing but the server)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


SHADOW_NICE = 10
STARTUP_TIMEOUT_S = 300.0


@dataclass(slots=True)
class TrainerProc:
    rank: int
    generation: int
    proc: subprocess.Popen
    spawned: float
    last_beat: float | None = None
    reported: bool = False
    beat: RankBeat | None = None
    """Its last heartbeat."""
    log: str | None = None
    cpu_mark: int | None = None
    """CPU ticks when heartbeats were first found late (None while beats are on time)."""

    @property
    def completed(self) -> int:
        return self.beat.completed if self.beat is not None else -1

    def traceback(self) -> str:
        """The last traceback the trainer wrote to its log ("" if none)."""
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(self.log) - 65536))
            text = fh.read().decode(errors="replace")
        at = text.rfind("Traceback (most recent call last):")
        return text[at:] if at >= 0 else ""

    def last_words(self) -> str:
        """The last line the trainer wrote to its log (why it died, if it said)."""
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(self.log) - 2048))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""


class Agent:
    def __init__(
        self,
        channel: Channel,
        node: int,
        hb: socket.socket,
        hb_addr: str,
        rc: socket.socket,
        rc_addr: str,
    ) -> None:
        self.channel = channel
        self.node = node
        self.hb = hb
        self.hb_addr = hb_addr
        self.rc = rc
        self.rc_addr = rc_addr
        self.trainers: dict[int, TrainerProc] = {}
        self.shadows: dict[int, TrainerProc] = {}
        """Pre-initialized trainers for the next generation (see unbroken.shadow)."""
        self.state_managers: dict[int, subprocess.Popen] = {}
        self.forkserver = None
        """The node's pre-imported fork server for shadows (`unbroken.shadow.forkserver`),
        started with the first generation that has shadows (recovery.shadow_start = fork)."""
        self.memory = None
        """The reclamation controller (`unbroken.shadow.controller`) under a memory budget."""
        self._shadow_attempt = 0
        self._shadow_level_now = 0
        self._device_policy = None
        """Level policy for allocation failures reported by trainers (device OOM)."""
        """Sets of shadows started so far (each rendezvouses under its own store prefix)."""
        self._relaunch_after: tuple[int, int, int, int] | None = None
        """(rank, iteration, level, generation): shadows reclaimed for a trainer's allocation
        failure come back once that trainer's heartbeat shows it got past the iteration it
        retried — a shadow starting meanwhile would compete for the memory just freed."""
        self._pending_shadows: tuple[dict, int, int, list[int]] | None = None
        """(start message, generation, level, ranks) of shadows waiting for the fork server to
        finish its imports; spawned from the supervision loop, never blocking it."""
        self.heartbeat_timeout_s = 2.0
        self.node_beat_s = 0.5
        self._last_node_beat = 0.0
        self.running = True
        self.sel = selectors.DefaultSelector()
        self._last_start: StartGeneration | None = None

    # -- commands -------------------------------------------------------------------------
    def ensure_state_managers(self, sockets: dict[str, str]) -> None:
        """One state manager per rank, started once and kept across trainer generations (they
        own the retained memory); they exit with the agent."""
        for rank_s, path in sockets.items():
            rank = int(rank_s)
            proc = self.state_managers.get(rank)
            if proc is None or proc.poll() is not None:
                cmd = [sys.executable, "-m", "unbroken.state.manager", "--socket", path]
                cmd += ["--rank", str(rank)]
                with open(f"{path}.log", "ab") as log:  # keep the terminal for progress
                    self.state_managers[rank] = subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        preexec_fn=self._preexec(0) if self.memory else None,
                    )

    def _spawn(
        self, msg: StartGeneration, rank: int, generation: int, spec: str, shadow_level: int
    ):
        cmd = [sys.executable, "-m", "unbroken.launch.trainer", "--spec", spec]
        cmd += ["--rank", str(rank), "--heartbeat", self.hb_addr, "--reclaim", self.rc_addr]
        if rank in msg.ranks:  # one GPU per local rank on a multi-GPU node
            cmd += ["--local-rank", str(sorted(msg.ranks).index(rank))]
        if shadow_level:
            cmd += ["--shadow", str(shadow_level), "--attempt", str(self._shadow_attempt)]
        stdin = subprocess.PIPE if shadow_level else subprocess.DEVNULL
        # Shadows pre-initialize in the background: at a lower CPU priority they do not slow
        # the active trainers they stand behind (they restore their priority when promoted).
        nice = SHADOW_NICE if shadow_level else 0
        preexec = self._preexec(nice)

        log_path = None
        if msg.log_dir:
            os.makedirs(msg.log_dir, exist_ok=True)
            kind = "shadow" if shadow_level else "gen"
            log_path = os.path.join(msg.log_dir, f"{kind}{generation}-rank{rank}.log")
        if shadow_level and self._forkserver_ready():
            procs = self.memory.budget.procs_file if self.memory else None
            proc = self.forkserver.spawn(cmd[3:], log_path, nice, cgroup_procs=procs)
            return TrainerProc(rank, generation, proc, time.time(), log=log_path)
        if log_path:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    cmd, stdin=stdin, stdout=log, stderr=log, preexec_fn=preexec
                )
        else:
            proc = subprocess.Popen(cmd, stdin=stdin, preexec_fn=preexec)
        return TrainerProc(rank, generation, proc, time.time(), log=log_path)

    def _preexec(self, nice: int):
        """What a child runs between fork and exec: die with the agent, join the job's memory
        budget (before it allocates anything), lower its priority."""
        procs = self.memory.budget.procs_file if self.memory else None

        def preexec() -> None:
            _die_with_parent()
            if procs:
                fd = os.open(procs, os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
            if nice:
                os.nice(nice)

        return preexec

    def _forkserver_ready(self) -> bool:
        return self.forkserver is not None and self.forkserver.ready.is_set()

    def _spawn_pending_shadows(self) -> None:
        """Spawn the waiting shadows once the fork server is ready (or has failed: then with
        exec, as without one)."""
        if self._pending_shadows is None:
            return
        fs = self.forkserver
        if fs is not None and not fs.ready.is_set() and fs.failed is None:
            return
        msg, generation, level, ranks = self._pending_shadows
        self._pending_shadows = None
        self._shadow_attempt += 1
        for r in ranks:
            assert msg.shadows is not None
            self.shadows[r] = self._spawn(msg, r, generation, msg.shadows.next_spec, level)

    def _shadows_alive(self, generation: int, ranks: list[int]) -> bool:
        """Every rank has a live shadow for `generation`. It need not have reached its level
        yet: a promoted shadow finishes its pre-initialization first, which still beats
        starting a process from nothing."""
        return all(
            (t := self.shadows.get(r)) is not None
            and t.generation == generation
            and t.proc.poll() is None
            for r in ranks
        )

    def _shadows_ready(self, ranks: list[int]) -> int:
        return sum(
            (b := self.shadows[r].beat) is not None and b.status is RankStatus.SHADOW_READY
            for r in ranks
        )

    def kill_shadows(self) -> None:
        self._pending_shadows = None
        for t in self.shadows.values():  # all at once, then wait: their memory returns together
            if t.proc.poll() is None:
                t.proc.kill()
        for t in self.shadows.values():
            t.proc.wait()
        self.shadows.clear()

    def start(self, msg: StartGeneration) -> None:
        """Start a generation: promote its shadows when every rank has a ready one (no process
        start, no rendezvous), else spawn trainers; then pre-initialize the next shadows."""
        self.heartbeat_timeout_s = msg.heartbeat_timeout_s
        self.node_beat_s = msg.node_heartbeat_s
        if msg.state_managers:
            self.ensure_state_managers(msg.state_managers)
        gen, ranks = msg.generation, msg.ranks
        self._setup_memory(msg)
        self._last_start = msg
        promoted = self._shadows_alive(gen, ranks)
        ready = self._shadows_ready(ranks) if promoted else 0
        if promoted:
            for r in ranks:
                t = self.shadows.pop(r)
                with contextlib.suppress(OSError):  # full priority now (needs privilege)
                    os.setpriority(os.PRIO_PROCESS, t.proc.pid, 0)
                assert t.proc.stdin is not None
                t.proc.stdin.write(encode_json(Promote(spec=msg.spec)) + b"\n")
                t.proc.stdin.flush()
                t.last_beat = time.time()
                self.trainers[r] = t
        else:
            self.kill_shadows()
            for r in ranks:
                self.trainers[r] = self._spawn(msg, r, gen, msg.spec, 0)
        self._relaunch_after = None  # this start brings its own shadows
        level = msg.shadows.level if msg.shadows is not None else 0
        if level and self._device_policy is not None:
            self._device_policy.at_recovery(None, len(ranks))  # a recovery resets the cap
        if level and self.memory is not None:
            chosen = self.memory.level_for_next(len(ranks))
            if chosen != level:
                self._memory_event(
                    "shadow_level",
                    generation=gen + 1,
                    level=chosen,
                    configured=level,
                    peak_active_mb=(self.memory.peak_active or 0) / (1 << 20),
                    reason="at recovery: the level the observed peak memory leaves room for",
                )
            level = chosen
        launched = None
        if level and msg.shadows is not None:
            if self.forkserver is None and msg.shadows.start == "fork":
                from unbroken.launch.trainer import TRAINER_IMPORTS
                from unbroken.shadow.forkserver import ShadowForkServer

                self.forkserver = ShadowForkServer(TRAINER_IMPORTS)
            self._pending_shadows = (msg, gen + 1, level, ranks)
            self._spawn_pending_shadows()
            fs = self.forkserver
            start = "fork" if fs is not None and fs.failed is None else "exec"
            self._shadow_level_now = level
            launched = ShadowLaunch(
                level=level,
                generation=gen + 1,
                start=start,
                fork_failed=fs.failed if fs is not None and fs.failed else None,
            )
        self.channel.send(
            Started(
                generation=gen,
                t=time.time(),
                promoted=promoted,
                shadows_ready=ready,
                shadows=launched,
            )
        )

    # -- memory budget (unbroken.shadow.memory / controller) ----------------------------------
    def _setup_memory(self, msg: StartGeneration) -> None:
        budget_mb = msg.memory_budget_mb
        if not budget_mb or self.memory is not None:
            return
        from unbroken.shadow.controller import ReclaimController
        from unbroken.shadow.memory import MemoryBudget
        from unbroken.shadow.policy import LevelPolicy

        reclaim = msg.memory_reclaim
        budget = MemoryBudget(f"unbroken-agent{os.getpid()}", budget_mb << 20, reclaim)
        configured = msg.shadows.level if msg.shadows is not None else 0
        policy = LevelPolicy(configured=configured, budget=budget.limit)
        self.memory = ReclaimController(budget, policy)
        if budget.eventfd is not None:
            self.sel.register(budget.eventfd, selectors.EVENT_READ, "oom")
        self._memory_event(
            "memory_budget", budget_mb=budget_mb, reclaim=reclaim, cgroup=str(budget.path)
        )

    def _memory_event(self, event: str, **fields) -> None:
        self.channel.send(MemoryReport(event=event, t=time.time(), fields=fields))

    def _on_oom(self) -> None:
        """An allocation is waiting on the budget: reclaim the shadows (Leto §6)."""
        mem = self.memory
        assert mem is not None
        live = [t for t in self.shadows.values() if t.proc.poll() is None]
        verdict = mem.on_oom([t.proc.pid for t in live], self._shadow_level_now)
        if verdict == "real":
            self._memory_event(
                "oom",
                usage_mb=mem.budget.usage() / (1 << 20),
                budget_mb=mem.budget.limit / (1 << 20),
                reason="out of budget with no shadow to reclaim: the kernel OOM killer acts",
            )
            return
        if verdict != "reclaim":
            return
        pending = self._pending_shadows
        self.kill_shadows()  # SIGKILL, then wait until each is gone (its memory returned)
        fields = mem.reclaimed(len(self.trainers))
        self._memory_event("shadows_reclaimed", **fields)
        if pending is None and live:
            self._relaunch_shadows(fields["level_to"], live[0].generation)

    def _relaunch_shadows(self, level: int, generation: int) -> None:
        """After a reclamation: the same generation's shadows again, at `level` (0: none)."""
        self._shadow_level_now = level
        if level:
            self._pending_shadows = (self._last_start, generation, level, sorted(self.trainers))
            self._spawn_pending_shadows()

    def _on_reclaim_request(self, req: ReclaimRequest) -> None:
        """A trainer's allocation failed (its allocator's OOM): reclaim the shadows, wait until
        they are gone, answer; relaunch them at a level the policy allows (Leto §6)."""
        from unbroken.shadow.policy import LevelPolicy

        t0 = time.monotonic()
        live = [t for t in self.shadows.values() if t.proc.poll() is None]
        answer = ReclaimAnswer(reclaimed=len(live))
        if live:
            level_from = self._shadow_level_now
            pending = self._pending_shadows
            self.kill_shadows()
            if self._device_policy is None:
                shadows = self._last_start.shadows if self._last_start else None
                self._device_policy = LevelPolicy(
                    configured=shadows.level if shadows is not None else 0,
                    budget=req.total or (1 << 62),
                )
            level = self._device_policy.after_reclaim(active=req.used or 0, shadows=len(live))
            answer = ReclaimAnswer(
                reclaimed=len(live), level_to=level, wait_s=time.monotonic() - t0
            )
            self._memory_event(
                "shadows_reclaimed",
                cause=f"allocation failure in rank {req.rank}: {req.reason}",
                t_oom=req.t,
                shadows=len(live),
                level_from=level_from,
                level_to=level,
                wait_s=answer.wait_s,
                device_used_mb=(req.used or 0) / (1 << 20),
            )
            if pending is None and req.iteration is None:
                self._relaunch_shadows(level, live[0].generation)
            elif pending is None:
                self._relaunch_after = (req.rank, req.iteration, level, live[0].generation)
        else:
            self._memory_event(
                "oom",
                reason=f"allocation failure in rank {req.rank} with no shadow to reclaim",
            )
        with contextlib.suppress(OSError):  # a trainer that died meanwhile needs no answer
            self.rc.sendto(encode_json(answer), req.reply.replace("@", "\0", 1))

    def _sample_memory(self) -> None:
        if self.memory is None or not self.running:
            return
        shadows = {
            t.proc.pid: (t.proc.poll() is None, t.beat.footprint if t.beat else None)
            for t in self.shadows.values()
        }
        self.memory.sample(shadows)

    def kill_all(self) -> None:
        """SIGKILL every trainer (stopped ones too) and reap them. State managers stay."""
        for t in self.trainers.values():
            if t.proc.poll() is None:
                t.proc.send_signal(signal.SIGKILL)
        for t in self.trainers.values():
            t.proc.wait()
        self.trainers.clear()

    def kill_state_managers(self) -> None:
        for proc in self.state_managers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.state_managers.clear()

    def shutdown_all(self) -> None:
        """Every child gone, then the memory cgroup removed."""
        self.kill_all()
        self.kill_shadows()
        self.kill_state_managers()
        if self.memory is not None:
            self.memory.budget.close()

    def stop(self, msg: StopGeneration) -> None:
        t0 = time.time()
        self.kill_all()
        self.channel.send(
            Stopped(generation=msg.generation, t=time.time(), took_s=time.time() - t0)
        )

    # -- supervision ----------------------------------------------------------------------
    def drain_heartbeats(self) -> None:
        while True:
            try:
                data = self.hb.recv(4096)
            except BlockingIOError:
                return
            try:
                beat = decode_json(data, (RankBeat,))
            except MessageError:
                continue  # a garbled datagram is ignored, never fatal
            assert isinstance(beat, RankBeat)
            t = self.trainers.get(beat.rank)
            if t is None or beat.generation != t.generation:
                t = self.shadows.get(beat.rank)
            if t is not None and beat.generation == t.generation:
                t.last_beat = time.time()
                t.beat = beat
                t.cpu_mark = None
            self._maybe_relaunch(beat)

    def drain_reclaim_requests(self) -> None:
        while True:
            try:
                data = self.rc.recv(4096)
            except BlockingIOError:
                return
            try:
                req = decode_json(data, (ReclaimRequest,))
            except MessageError:
                continue  # a garbled datagram is ignored, never fatal
            assert isinstance(req, ReclaimRequest)
            self._on_reclaim_request(req)

    def _maybe_relaunch(self, beat: RankBeat) -> None:
        after = self._relaunch_after
        if after is None or beat.rank != after[0]:
            return
        if beat.iteration > after[1]:
            self._relaunch_after = None
            self._relaunch_shadows(after[2], after[3])

    def check_children(self) -> None:
        now = time.time()
        for t in self.trainers.values():
            if t.reported:
                continue
            code = t.proc.poll()
            if code is not None:
                t.reported = True
                if self.memory is not None and all(x.reported for x in self.trainers.values()):
                    # The generation is over. The report goes before the last exit: on that
                    # one the coordinator may shut down and read nothing more.
                    self._memory_event("memory_report", **self.memory.report())
                self.channel.send(
                    RankExited(
                        rank=t.rank,
                        generation=t.generation,
                        returncode=code,
                        t=now,
                        said=t.last_words() if code > 0 else "",
                        completed=t.completed,
                        iteration=t.beat.iteration if t.beat else -1,
                        phase=t.beat.phase if t.beat else "",
                        traceback=t.traceback() if code > 0 and self._debug() else "",
                    )
                )
                continue
            last = t.last_beat if t.last_beat is not None else t.spawned
            if t.last_beat is None or (t.beat is not None and t.beat.status is RankStatus.EXITING):
                limit = STARTUP_TIMEOUT_S
            else:
                limit = self.heartbeat_timeout_s
            if now - last > limit and not self._still_working(t):
                t.reported = True
                self.channel.send(
                    RankHung(
                        rank=t.rank,
                        generation=t.generation,
                        silent_s=now - last,
                        t=now,
                        phase=t.beat.phase if t.beat else "",
                        iteration=t.beat.iteration if t.beat else -1,
                        completed=t.completed,
                    )
                )

    @staticmethod
    def _cpu_state(pid: int) -> tuple[str, int]:
        """(state letter, user+system CPU ticks) of a process, from /proc."""
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            return "X", 0
        return fields[0], int(fields[11]) + int(fields[12])

    def _still_working(self, t: TrainerProc) -> bool:
        """A trainer whose heartbeats are late but which keeps burning CPU is starved (an
        oversubscribed machine), not hung: it gets half a timeout more, then is checked again.
        A stopped (SIGSTOP) process, or one asleep without CPU progress (stuck in a
        collective), is hung."""
        state, ticks = self._cpu_state(t.proc.pid)
        if state == "T":
            return False
        previous, t.cpu_mark = t.cpu_mark, ticks
        if previous is None or ticks > previous:
            t.last_beat = time.time() - self.heartbeat_timeout_s / 2
            return True
        return False

    def _debug(self) -> bool:
        return self._last_start is not None and self._last_start.debug

    def handle(self, msg) -> None:
        if isinstance(msg, StartGeneration):
            self.start(msg)
        elif isinstance(msg, StopGeneration):
            self.stop(msg)
        elif isinstance(msg, Shutdown):
            self.shutdown_all()
            self.running = False

    def serve(self) -> None:
        sel = self.sel
        sel.register(self.channel.sock, selectors.EVENT_READ, "ctl")
        sel.register(self.hb, selectors.EVENT_READ, "hb")
        sel.register(self.rc, selectors.EVENT_READ, "rc")
        for msg in self.channel.take_pending():
            self.handle(msg)
        while self.running:
            for key, _ in sel.select(timeout=TICK_S):
                if key.data == "hb":
                    self.drain_heartbeats()
                elif key.data == "rc":
                    self.drain_reclaim_requests()
                elif key.data == "oom":
                    self._on_oom()
                else:
                    data = self.channel.sock.recv(65536)
                    if not data:
                        # Coordinator gone: nothing may run unsupervised.
                        self.shutdown_all()
                        return
                    for msg in self.channel.feed(data):
                        self.handle(msg)
            self.check_children()
            self._spawn_pending_shadows()
            self._sample_memory()
            now = time.time()
            if now - self._last_node_beat >= self.node_beat_s:
                # The node's liveness for the coordinator: a decision-free beat, one per interval
                # (raw trainer heartbeats never leave the node).
                self._last_node_beat = now
                self.channel.send(NodeBeat(t=now, trainers=len(self.trainers)))


def _datagram_socket(kind: str) -> tuple[socket.socket, str]:
    """A non-blocking Unix datagram socket at a fresh abstract address ("@..." form)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = f"\0unbroken-{kind}-{os.getpid()}-{os.urandom(4).hex()}"
    sock.bind(addr)
    sock.setblocking(False)
    return sock, addr.replace("\0", "@")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-agent")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--node", type=int, default=0)
    args = parser.parse_args(argv)
    secret = os.environ.get("UNBROKEN_JOB_SECRET")
    if not secret:
        print("unbroken-agent: UNBROKEN_JOB_SECRET is not set", file=sys.stderr)
        return 2
    host, _, port = args.coordinator.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = Channel(sock, bytes.fromhex(secret), FROM_COORDINATOR)
    hb, hb_addr = _datagram_socket("hb")
    rc, rc_addr = _datagram_socket("reclaim")
    channel.send(Hello(node=args.node, pid=os.getpid(), host=socket.gethostname()))
    agent = Agent(channel, args.node, hb, hb_addr, rc, rc_addr)
    try:
        agent.serve()
    except ProtocolError as exc:
        print(f"unbroken-agent: rejected a control message: {exc}", file=sys.stderr)
        agent.shutdown_all()
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"unbroken-agent: lost the coordinator: {exc}", file=sys.stderr)
        agent.shutdown_all()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
