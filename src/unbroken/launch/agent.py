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
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from unbroken.launch.protocol import COORDINATOR_OPS, Channel, ProtocolError

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
    info: dict = field(default_factory=dict)
    log: str | None = None
    cpu_mark: int | None = None
    """CPU ticks when heartbeats were first found late (None while beats are on time)."""

    def last_words(self) -> str:
        """The last line the trainer wrote to its log (why it died, if it said)."""
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(self.log) - 2048))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""


class Agent:
    def __init__(self, channel: Channel, node: int, hb: socket.socket, hb_addr: str) -> None:
        self.channel = channel
        self.node = node
        self.hb = hb
        self.hb_addr = hb_addr
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
        self._last_start: dict = {}

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

    def _spawn(self, msg: dict, rank: int, generation: int, spec: str, shadow_level: int):
        cmd = [sys.executable, "-m", "unbroken.launch.trainer", "--spec", spec]
        cmd += ["--rank", str(rank), "--heartbeat", self.hb_addr]
        if rank in msg.get("ranks", ()):  # one GPU per local rank on a multi-GPU node
            cmd += ["--local-rank", str(sorted(msg["ranks"]).index(rank))]
        if shadow_level:
            cmd += ["--shadow", str(shadow_level), "--attempt", str(self._shadow_attempt)]
        stdin = subprocess.PIPE if shadow_level else subprocess.DEVNULL
        # Shadows pre-initialize in the background: at a lower CPU priority they do not slow
        # the active trainers they stand behind (they restore their priority when promoted).
        nice = SHADOW_NICE if shadow_level else 0
        preexec = self._preexec(nice)

        log_path = None
        if msg.get("log_dir"):
            os.makedirs(msg["log_dir"], exist_ok=True)
            kind = "shadow" if shadow_level else "gen"
            log_path = os.path.join(msg["log_dir"], f"{kind}{generation}-rank{rank}.log")
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
            self.shadows[r] = self._spawn(msg, r, generation, msg["next_spec"], level)

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
            str(self.shadows[r].info.get("phase", "")).startswith("shadow-ready") for r in ranks
        )

    def kill_shadows(self) -> None:
        self._pending_shadows = None
        for t in self.shadows.values():  # all at once, then wait: their memory returns together
            if t.proc.poll() is None:
                t.proc.kill()
        for t in self.shadows.values():
            t.proc.wait()
        self.shadows.clear()

    def start(self, msg: dict) -> None:
        """Start a generation: promote its shadows when every rank has a ready one (no process
        start, no rendezvous), else spawn trainers; then pre-initialize the next shadows."""
        self.heartbeat_timeout_s = float(msg["heartbeat_timeout_s"])
        self.node_beat_s = float(msg.get("node_heartbeat_s", self.node_beat_s))
        if msg.get("state_managers"):
            self.ensure_state_managers(msg["state_managers"])
        gen, ranks = msg["generation"], msg["ranks"]
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
                t.proc.stdin.write((json.dumps({"spec": msg["spec"]}) + "\n").encode())
                t.proc.stdin.flush()
                t.last_beat = time.time()
                self.trainers[r] = t
        else:
            self.kill_shadows()
            for r in ranks:
                self.trainers[r] = self._spawn(msg, r, gen, msg["spec"], 0)
        self._relaunch_after = None  # this start brings its own shadows
        level = int(msg.get("shadow_level") or 0)
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
        levels = {}
        if level and msg.get("next_spec"):
            if self.forkserver is None and msg.get("shadow_start", "fork") == "fork":
                from unbroken.launch.trainer import TRAINER_IMPORTS
                from unbroken.shadow.forkserver import ShadowForkServer

                self.forkserver = ShadowForkServer(TRAINER_IMPORTS)
            self._pending_shadows = (msg, gen + 1, level, ranks)
            self._spawn_pending_shadows()
            fs = self.forkserver
            start = "fork" if fs is not None and fs.failed is None else "exec"
            levels = {"level": level, "generation": gen + 1, "start": start}
            self._shadow_level_now = level
            if fs is not None and fs.failed:
                levels["fork_failed"] = fs.failed
        self.channel.send(
            "started",
            generation=gen,
            t=time.time(),
            promoted=promoted,
            shadows_ready=ready,
            shadows=levels,
        )

    # -- memory budget (unbroken.shadow.memory / controller) ----------------------------------
    def _setup_memory(self, msg: dict) -> None:
        budget_mb = int(msg.get("memory_budget_mb") or 0)
        if not budget_mb or self.memory is not None:
            return
        from unbroken.shadow.controller import ReclaimController
        from unbroken.shadow.memory import MemoryBudget
        from unbroken.shadow.policy import LevelPolicy

        reclaim = bool(msg.get("memory_reclaim", True))
        budget = MemoryBudget(f"unbroken-agent{os.getpid()}", budget_mb << 20, reclaim)
        policy = LevelPolicy(configured=int(msg.get("shadow_level") or 0), budget=budget.limit)
        self.memory = ReclaimController(budget, policy)
        if budget.eventfd is not None:
            self.sel.register(budget.eventfd, selectors.EVENT_READ, "oom")
        self._memory_event(
            "memory_budget", budget_mb=budget_mb, reclaim=reclaim, cgroup=str(budget.path)
        )

    def _memory_event(self, event: str, **fields) -> None:
        self.channel.send("memory", event=event, t=time.time(), **fields)

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

    def _on_reclaim_request(self, req: dict) -> None:
        """A trainer's allocation failed (its allocator's OOM): reclaim the shadows, wait until
        they are gone, answer; relaunch them at a level the policy allows (Leto §6)."""
        from unbroken.shadow.policy import LevelPolicy

        t0 = time.monotonic()
        live = [t for t in self.shadows.values() if t.proc.poll() is None]
        answer: dict = {"reclaimed": len(live)}
        if live:
            level_from = self._shadow_level_now
            pending = self._pending_shadows
            self.kill_shadows()
            if self._device_policy is None:
                self._device_policy = LevelPolicy(
                    configured=int(self._last_start.get("shadow_level") or 0),
                    budget=int(req.get("total") or 0) or (1 << 62),
                )
            level = self._device_policy.after_reclaim(
                active=int(req.get("used") or 0), shadows=len(live)
            )
            answer.update(level_to=level, wait_s=time.monotonic() - t0)
            self._memory_event(
                "shadows_reclaimed",
                cause=f"allocation failure in rank {req['rank']}: {req.get('reason', '')}",
                t_oom=req.get("t"),
                shadows=len(live),
                level_from=level_from,
                level_to=level,
                wait_s=answer["wait_s"],
                device_used_mb=(req.get("used") or 0) / (1 << 20),
            )
            if pending is None and req.get("iteration") is None:
                self._relaunch_shadows(level, live[0].generation)
            elif pending is None:
                self._relaunch_after = (req["rank"], req["iteration"], level, live[0].generation)
        else:
            self._memory_event(
                "oom",
                reason=f"allocation failure in rank {req['rank']} with no shadow to reclaim",
            )
        with contextlib.suppress(OSError):  # a trainer that died meanwhile needs no answer
            self.hb.sendto(json.dumps(answer).encode(), req["reply"].replace("@", "\0", 1))

    def _sample_memory(self) -> None:
        if self.memory is None or not self.running:
            return
        shadows = {
            t.proc.pid: (t.proc.poll() is None, t.info.get("footprint"))
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

    def stop(self, msg: dict) -> None:
        t0 = time.time()
        self.kill_all()
        self.channel.send(
            "stopped", generation=msg["generation"], t=time.time(), took_s=time.time() - t0
        )

    # -- supervision ----------------------------------------------------------------------
    def drain_heartbeats(self) -> None:
        while True:
            try:
                data = self.hb.recv(4096)
            except BlockingIOError:
                return
            try:
                beat = json.loads(data)
                if beat.get("op") == "reclaim":
                    self._on_reclaim_request(beat)
                    continue
                t = self.trainers.get(int(beat["rank"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a garbled datagram is ignored, never fatal
            if t is None or beat.get("generation") != t.generation:
                t = self.shadows.get(int(beat["rank"]))
            if t is not None and beat.get("generation") == t.generation:
                t.last_beat = time.time()
                t.info = beat
                t.cpu_mark = None
            self._maybe_relaunch(beat)

    def _maybe_relaunch(self, beat: dict) -> None:
        after = self._relaunch_after
        if after is None or beat.get("rank") != after[0]:
            return
        if int(beat.get("iter", -1)) > after[1]:
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
                    "rank_exit",
                    rank=t.rank,
                    generation=t.generation,
                    returncode=code,
                    t=now,
                    said=t.last_words() if code > 0 else "",
                )
                continue
            last = t.last_beat if t.last_beat is not None else t.spawned
            if t.last_beat is None or t.info.get("phase") == "exiting":
                limit = STARTUP_TIMEOUT_S
            else:
                limit = self.heartbeat_timeout_s
            if now - last > limit and not self._still_working(t):
                t.reported = True
                self.channel.send(
                    "rank_hung",
                    rank=t.rank,
                    generation=t.generation,
                    silent_s=now - last,
                    last=t.info,
                    t=now,
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

    def handle(self, msg: dict) -> None:
        op = msg["op"]
        if op == "start":
            self.start(msg)
        elif op == "stop":
            self.stop(msg)
        elif op == "shutdown":
            self.shutdown_all()
            self.running = False

    def serve(self) -> None:
        sel = self.sel
        sel.register(self.channel.sock, selectors.EVENT_READ, "ctl")
        sel.register(self.hb, selectors.EVENT_READ, "hb")
        for msg in self.channel.take_pending():
            self.handle(msg)
        while self.running:
            for key, _ in sel.select(timeout=TICK_S):
                if key.data == "hb":
                    self.drain_heartbeats()
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
                self.channel.send("beat", t=now, trainers=len(self.trainers))


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
    channel = Channel(sock, bytes.fromhex(secret), COORDINATOR_OPS)
    hb = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    hb_addr = f"\0unbroken-hb-{os.getpid()}-{os.urandom(4).hex()}"
    hb.bind(hb_addr)
    hb.setblocking(False)
    channel.send("hello", node=args.node, pid=os.getpid())
    agent = Agent(channel, args.node, hb, hb_addr.replace("\0", "@"))
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
