"""Fires scheduled faults from inside a trainer, at phase hooks.

The injector is a phase hook. Before a fault acts, it marks it fired in the job store (so it
fires once per job, also across restarts) and appends a `failure_injected` event with the
wall-clock time, iteration and phase — that time is t_fault of the recovery metrics. It never
tells the recovery side where or what failed: detection and localization find that out
themselves.

[Note: slow-fault] A `slow` fault stalls for real (the process sleeps: no timestamp is edited,
no training state is touched, so a slowed run stays bit-identical). The injector is called at
the start of every phase step and stalls for the step that just ended:

- `what=compute` (default): after every step that is not a gradient all-reduce bucket, sleep
  (F - 1) x the rank's own work in that step, so its compute takes F x as long as it did. On a
  `Trainer` rank that is the step's duration. On a plan's rank a step also holds waits for
  peers (a p2p batch waiting for a neighbour's compute, TP collectives, the reductions), which
  a slower device does not stretch: the worker gives the injector a clock of its own work
  (`use_busy_clock`, [Note: plan hooks] in `unbroken.engine.interpreter`), and the step's
  duration on that clock is what is stretched, at the end of each compute action
  (`after_compute`, inside the action's timed seconds) and, for what follows it, at the next
  hook. On a CUDA device the hooks run ahead of the
  kernels, so while the fault is active the injector first waits for the device at each hook:
  the step's duration is then its kernels' (a healthy run is never synchronized by it).
- `what=comm`: after each all-reduce bucket b (at the next ALLREDUCE or the REDUCED hook), sleep
  (F - 1) x d_b, where d_b is bucket b's healthy duration on this rank: the shortest of its
  last `HISTORY` iterations before the fault (the shortest, because a rank that reached the
  all-reduce first also waited there for its peers). On a plan's rank, also after each p2p
  batch that sends (`after_transfer`, inside the batch's time), sleep (F - 1) x the rank's
  link time: its shortest p2p batch of the same history (one that did not wait for a peer;
  a batch that receives mostly waits for the sender's compute, which is not the link). The
  stall is frozen when the fault becomes active: a slow link adds the same time to every
  transfer. The rank's transfers return late; its peers go on and wait for it in the next
  collective (the next bucket, or the loss all-reduce of the sync phase) or the next p2p
  batch with it.
- `level=weak|medium|severe` instead of `factor=`: compute uses `slow_factor_for(level)`
  (s = 1); comm uses `comm_factor_for(level, s)` with s = (sum of d_b + the link time x the
  sending batches of an iteration) over this rank's median iteration period (FORWARD 0 to
  FORWARD 0) of the same history, so the stall per iteration is L / (1 - L) x the healthy
  iteration, whatever the communication share. A comm fault fired before one full healthy
  iteration was seen becomes active once it has been (a rank with neither replicas nor
  pipeline neighbours has no communication, and it never does). Activation is logged as
  `slow_active` with the factor and the stall.
- `until=J`: from the first step of iteration J on the device is healthy again (both kinds:
  no more stalls), logged as `slow_ended`. Until then the slowness is the device's, not the
  process's: a trainer started on the device after the fault fired (a restart, or the planned
  stop of a re-plan that moves layers) stalls again from its first iteration, logged as
  `slow_resumed` (`_resume_slow`); once ended it is over for the job (the end is marked in the
  job store: a restart that redoes iterations before J runs at full speed). Without `until` a
  slow fault lasts as long as the trainer process.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unbroken.detect.levels import comm_factor_for, slow_factor_for
from unbroken.inject.faults import FaultKind, FaultSpec, InjectedFault, SlowTarget
from unbroken.jobstore import JobStore
from unbroken.train.phases import Phase
from unbroken.update.marker import Stage

__all__ = ["HISTORY", "Injector"]

HISTORY = 8
"""Healthy iterations remembered to calibrate a comm slow-down ([Note: slow-fault])."""


_KILLED = (
    FaultKind.KILL,
    FaultKind.PAGELOSS,
    FaultKind.CKPTCORRUPT,
    FaultKind.LOSE,
    FaultKind.NODELOSS,
    FaultKind.FLAKY,
)
"""Faults whose trainer is SIGKILLed once they have acted."""


class Injector:
    """A phase hook that fires this rank's faults.

    Args:
        faults: the job's fault schedule (faults of other ranks are ignored).
        rank: this trainer's rank.
        store: the job store (not a generation prefix), shared by all generations: a fault
            fires once per job (`JobStore.mark_fault_fired`).
        emit: appends an event to the job's event log.
        job_t0: wall time the job's first iteration started (for `at=` triggers).
        sleep: how a `slow` fault stalls (tests pass a recorder; the stall must be real).
        clock: monotonic clock timing the phase steps (tests pass a fake one). A plan's
            worker also hands it a clock of the rank's own work (`use_busy_clock`) and reports
            its p2p batches (`after_transfer`): [Note: plan hooks] in
            `unbroken.engine.interpreter`.
    """

    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        store: JobStore,
        emit: Callable[..., None],
        job_t0: float,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.store = store
        self.emit = emit
        self.job_t0 = job_t0
        self.iteration_start = time.time()
        self.slow_factor = 1.0
        self._slow: list[FaultSpec] = []
        """Slow faults that fired and still stall (`_end_slow` ends those with an `until`)."""
        self._resumed = False
        """Whether this trainer looked for slow faults that fired in an earlier one."""
        self.page_loss = None
        """`pageloss` target: fault -> {region: pages destroyed} (set by in-place trainers)."""
        self.checkpoint_root: Path | None = None
        """`ckptcorrupt` target: the job's checkpoint directory (set by the trainer)."""
        self.sleep = sleep
        self.clock = clock
        self.busy_clock = clock
        """The rank's own work, for compute stalls (a plan's worker sets it)."""
        self.comm_stall_s: dict[int, float] | None = None
        """Active comm slow-down: bucket -> seconds stalled after it."""
        self.p2p_stall_s: float | None = None
        """Active comm slow-down on a plan: seconds stalled after each sending p2p batch."""
        self._comm_fault: FaultSpec | None = None
        self._phase_start = self._busy_start = clock()
        self._last: tuple[Phase, int, int] | None = None
        self._bucket_s: dict[int, deque[float]] = {}
        self._links: deque[float] = deque(maxlen=HISTORY)
        """Per healthy iteration, the shortest p2p batch (plans)."""
        self._sends = 0
        """Sending p2p batches of the last complete iteration."""
        self._p2p_now: list | None = None
        """[iteration, shortest batch, sending batches] of the iteration in progress (plans)."""
        self._periods: deque[float] = deque(maxlen=HISTORY)
        self._iter_mark: tuple[int, float] | None = None
        self._spike = None
        """A `memspike` allocation, held until the next iteration starts."""
        self._failed_spike: tuple[str, int, int] | None = None
        """(fault key, iteration, bytes) of a `memspike` whose allocation ran out of memory:
        the allocation-failure path retries the iteration, and the spike asks again for the
        same bytes."""
        self.device = None
        """The trainer's device (set by the trainer): a `memspike` allocates there."""
        self.bitflip_target = None
        """`bitflip` target: this rank's flat parameters (set by the trainer)."""
        self.devices = None
        """`lose` target: the job's `DeviceRegistry` (set by the trainer); `rank` is the
        device this trainer runs on."""
        self.release_retained: Callable[[], None] | None = None
        """`lose`: destroys this device's retained memory (shuts its state manager down)."""

    @property
    def _on_cuda(self) -> bool:
        """Whether the trainer computes on a GPU."""
        return self.device is not None and self.device.type == "cuda"

    def _fired(self, fault: FaultSpec) -> bool:
        return self.store.fault_fired(fault.key)

    def _matches(self, fault: FaultSpec, phase: Phase, it: int, step: int, n: int) -> bool:
        if fault.at_s is not None:
            return time.time() - self.job_t0 >= fault.at_s
        later = fault.kind is FaultKind.FLAKY or fault.phase is Phase.MOVE
        at = it >= fault.iteration if later else it == fault.iteration
        if fault.step is None and phase is Phase.MARKER:
            # The update's first commit write: SYNCED after its first chunk transaction, or
            # IDLE when it has only one (a small state in 2 MiB GPU pages); SYNCED alone
            # (the middle stage, n // 2) was never written inside such an update.
            return at and fault.phase == phase and step in (Stage.SYNCED, Stage.IDLE)
        want_step = fault.step if fault.step is not None else n // 2
        return at and fault.phase == phase and step == min(want_step, n - 1)

    def use_busy_clock(self, clock: Callable[[], float]) -> None:
        """Stretch compute by `clock`, the rank's own work, instead of wall time ([Note:
        slow-fault]); a plan's worker calls it ([Note: plan hooks] in
        `unbroken.engine.interpreter`)."""
        self.busy_clock = clock
        self._busy_start = clock()

    def after_compute(self, iteration: int) -> None:
        """Called by a plan's worker at the end of each compute action, inside its timed
        seconds: the compute stall of the step that just ran lands in the action, as a slower
        device's kernels would ([Note: slow-fault]); the next hook then stalls only for the
        rank's own work after it."""
        if self.slow_factor <= 1.0 or self._last is None:
            return
        if self._on_cuda:
            import torch

            torch.cuda.synchronize(self.device)
        self.sleep((self.slow_factor - 1.0) * max(0.0, self.busy_clock() - self._busy_start))
        self._phase_start, self._busy_start = self.clock(), self.busy_clock()

    def after_transfer(self, iteration: int, seconds: float, sent: bool) -> None:
        """Called by a plan's worker after each p2p batch, inside the batch's time: stalls
        after a sending batch while a comm fault is active, else learns the link time."""
        if self.p2p_stall_s is None:
            self._roll_p2p(iteration)
            if self._p2p_now is None:
                self._p2p_now = [iteration, seconds, 0]
            self._p2p_now[1] = min(self._p2p_now[1], seconds)
            self._p2p_now[2] += sent
            self._activate_comm(iteration)
        if self.p2p_stall_s is not None and sent:
            self.sleep(self.p2p_stall_s)

    def _roll_p2p(self, iteration: int) -> None:
        """Close the p2p record of an earlier iteration into the healthy history."""
        done = self._p2p_now
        if done is not None and done[0] != iteration:
            self._links.append(done[1])
            self._sends = done[2]
            self._p2p_now = None

    def __call__(self, phase: Phase, iteration: int, step: int, n_steps: int) -> None:
        if self.slow_factor > 1.0 and self._on_cuda:
            # A slower GPU: the step's kernels, not their enqueueing, take F x as long. Wait
            # for them so the step's duration is the device's (only while the fault is active).
            import torch

            torch.cuda.synchronize(self.device)
        now = self.clock()
        self._stall(now - self._phase_start, self.busy_clock() - self._busy_start, iteration)
        # A rank with no forward in an iteration (an empty replica's, `unbroken.engine.probe`)
        # must still see its slowdown end: any hook of iteration `until` or later ends it.
        self._end_slow(iteration)
        self._last = (phase, iteration, step)
        if phase is Phase.FORWARD and step == 0:
            self._release_spike()  # a memory spike lasts one iteration
            self._end_slow(iteration)
            self._resume_slow(iteration)
            self.iteration_start = time.time()
            if self._iter_mark is not None and self._iter_mark[0] == iteration - 1:
                self._periods.append(now - self._iter_mark[1])
            self._iter_mark = (iteration, now)
        for fault in self.faults:
            if self._matches(fault, phase, iteration, step, n_steps) and (
                not self._fired(fault)
                or self._retrying(fault, iteration)
                or fault.kind is FaultKind.FLAKY
            ):
                self._fire(fault, phase, iteration, step)
        self._phase_start, self._busy_start = self.clock(), self.busy_clock()

    def _end_slow(self, iteration: int) -> None:
        """A slow fault with `until` stops stalling at that iteration."""
        ended = [f for f in self._slow if f.until is not None and iteration >= f.until]
        for fault in ended:
            self.store.mark_fault_fired(_ended(fault), time.time())
            self._slow.remove(fault)
            if fault.what is SlowTarget.COMM:
                self._comm_fault = None
                self.comm_stall_s = self.p2p_stall_s = None
            else:
                self.slow_factor = 1.0
            self.emit("slow_ended", rank=self.rank, iter=iteration, spec=fault.text())

    def _resume_slow(self, iteration: int) -> None:
        """At this trainer's first iteration: a slow fault with `until` that fired in an
        earlier trainer on this device and has not ended stalls here too ([Note: slow-fault])."""
        if self._resumed:
            return
        self._resumed = True
        for fault in self.faults:
            if (
                fault.kind is FaultKind.SLOW
                and fault.until is not None
                and iteration < fault.until
                and self._fired(fault)
                and not self.store.fault_fired(_ended(fault))
            ):
                self.emit("slow_resumed", rank=self.rank, iter=iteration, spec=fault.text())
                self._start_slow(fault, iteration)

    def _start_slow(self, fault: FaultSpec, iteration: int) -> None:
        """Stall from now on for `fault` (a comm fault once its healthy link time is known)."""
        self._slow.append(fault)
        if fault.what is SlowTarget.COMM:
            self._comm_fault = fault
            self._activate_comm(iteration)
            return
        factor = slow_factor_for(fault.level) if fault.level is not None else fault.factor
        self.slow_factor = factor
        self.emit(
            "slow_active",
            rank=self.rank,
            iter=iteration,
            what=SlowTarget.COMPUTE.value,
            factor=factor,
            spec=fault.text(),
        )

    def _release_spike(self) -> None:
        spike, self._spike = self._spike, None
        if spike is not None and getattr(spike, "is_cuda", False):
            import torch

            del spike
            torch.cuda.empty_cache()  # back to the device, not the trainer's allocator cache

    def _retrying(self, fault: FaultSpec, iteration: int) -> bool:
        f = self._failed_spike
        return f is not None and f[:2] == (fault.key, iteration)

    def _spike_bytes(self, fault: FaultSpec, iteration: int) -> int:
        if self._retrying(fault, iteration):
            return self._failed_spike[2]  # type: ignore[index]
        if not fault.over:
            return fault.mb << 20
        if not self._on_cuda:
            raise InjectedFault(f"{fault.text()}: over=N needs a CUDA device (use mb=N)")
        import torch

        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + (fault.over << 20)

    def _memspike(self, fault: FaultSpec, phase: Phase, iteration: int) -> None:
        """Real pages, written so the device or the kernel must back them. Under a memory
        budget with reclamation, this is where the allocation waits for the shadows' memory
        (unbroken.shadow.memory); on a GPU an allocation over capacity raises
        OutOfMemoryError, which the trainer's allocation-failure path answers."""
        nbytes = self._spike_bytes(fault, iteration)
        t0 = time.perf_counter()
        if self._on_cuda:
            import torch

            try:
                self._spike = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                self._failed_spike = (fault.key, iteration, nbytes)
                self.emit("memory_spike_failed", rank=self.rank, iter=iteration, mb=nbytes >> 20)
                raise
        else:
            self._spike = np.ones(nbytes, dtype=np.uint8)
        self._failed_spike = None
        self.emit(
            "memory_spike",
            rank=self.rank,
            iter=iteration,
            phase=phase.value,
            mb=nbytes >> 20,
            alloc_s=time.perf_counter() - t0,
            spec=fault.text(),
        )

    def _stall(self, step_s: float, own_s: float, iteration: int) -> None:
        """Stall for the phase step that just ended, `step_s` long, `own_s` of it the rank's
        own work ([Note: slow-fault])."""
        if self._last is None:
            return
        phase, _, step = self._last
        if phase is Phase.ALLREDUCE:
            if self.comm_stall_s is None:
                self._bucket_s.setdefault(step, deque(maxlen=HISTORY)).append(step_s)
                self._activate_comm(iteration)
            if self.comm_stall_s is not None:
                self.sleep(self.comm_stall_s.get(step, 0.0))
        elif self.slow_factor > 1.0:
            self.sleep((self.slow_factor - 1.0) * own_s)

    def _activate_comm(self, iteration: int) -> None:
        """Freeze the comm stall from the healthy history, if there is enough of it."""
        fault = self._comm_fault
        if fault is None or not self._periods:
            return
        self._roll_p2p(iteration)
        if self._p2p_now is not None and not self._links:
            return  # a plan's rank: its link time needs one complete iteration
        if not self._bucket_s and not self._links:
            return
        healthy = {b: min(d) for b, d in self._bucket_s.items()}
        link_s = min(self._links, default=0.0)
        sends = self._sends if self._links else 0
        comm_s = sum(healthy.values()) + sends * link_s
        period = statistics.median(self._periods)
        share = min(1.0, comm_s / period) if period > 0 else 1.0
        if fault.level is not None:
            factor = comm_factor_for(fault.level, share) if comm_s > 0 else 1.0
        else:
            factor = fault.factor
        self.comm_stall_s = {b: (factor - 1.0) * d for b, d in healthy.items()}
        self.p2p_stall_s = (factor - 1.0) * link_s if sends else None
        self._comm_fault = None
        self.emit(
            "slow_active",
            rank=self.rank,
            iter=iteration,
            what=SlowTarget.COMM.value,
            factor=factor,
            stall_s=sum(self.comm_stall_s.values()) + sends * (self.p2p_stall_s or 0.0),
            comm_s=comm_s,
            comm_share=share,
            link_s=link_s,
            sends=sends,
            spec=fault.text(),
        )

    def _lose(self, fault: FaultSpec) -> None:
        """The device is gone: recorded lost (what its probe would say), its retained memory
        destroyed; the trainer is killed next."""
        if self.devices is None:
            raise InjectedFault(f"{fault.text()}: no device registry (run under an agent)")
        self.devices.mark_lost(self.rank, f"injected: {fault.text()}")
        if self.release_retained is not None:
            self.release_retained()

    def _bitflip(self, fault: FaultSpec, phase: Phase, iteration: int) -> None:
        if self.bitflip_target is None:
            raise InjectedFault(f"{fault.text()}: no parameters to corrupt")
        offset = flip_byte(self.bitflip_target, fault)
        self.emit(
            "corruption_injected",
            rank=self.rank,
            iter=iteration,
            phase=phase.value,
            fault=fault.kind.value,
            spec=fault.text(),
            byte=offset,
        )

    @staticmethod
    def _die(fault: FaultSpec) -> None:
        """SIGKILL this trainer — after its node's agent, for a `nodeloss` (the node's other
        processes die with their agent)."""
        if fault.kind is FaultKind.NODELOSS:
            agent = os.environ.get("UNBROKEN_AGENT_PID")
            if agent is None:
                raise InjectedFault(f"{fault.text()}: no agent to take down (run under one)")
            os.kill(int(agent), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _fire(self, fault: FaultSpec, phase: Phase, iteration: int, step: int) -> None:
        if fault.kind is FaultKind.FLAKY and self._fired(fault):
            self.emit("flaky_crash", rank=self.rank, iter=iteration, spec=fault.text())
            self._die(fault)  # the broken device again: not a new injected fault
        self.store.mark_fault_fired(fault.key, time.time())
        if fault.kind is FaultKind.MEMSPIKE:
            self._memspike(fault, phase, iteration)  # not a failure unless memory runs out
            return
        if fault.kind is FaultKind.BITFLIP:
            self._bitflip(fault, phase, iteration)  # silent: nothing fails, the audit must see
            return
        if fault.kind is FaultKind.OOM:
            # Not a failure by itself: the trainer's allocation-failure path decides (it asks
            # for the shadows' memory and retries; a crash only if there is none to reclaim).
            import torch

            self.emit("oom_injected", rank=self.rank, iter=iteration, phase=phase.value)
            raise torch.OutOfMemoryError(f"injected allocation failure at {fault.text()}")
        destroyed = damaged = None
        if fault.kind is FaultKind.PAGELOSS:
            if self.page_loss is None:
                raise InjectedFault(f"{fault.text()}: no retained memory (recovery.mode)")
            destroyed = self.page_loss(fault)
        if fault.kind is FaultKind.CKPTCORRUPT:
            damaged = corrupt_newest_checkpoint(self.checkpoint_root, fault)
        if fault.kind is FaultKind.LOSE:
            self._lose(fault)
        self.emit(
            "failure_injected",
            rank=self.rank,
            iter=iteration,
            phase=phase.value,
            step=step,
            fault=fault.kind.value,
            spec=fault.text(),
            iter_t_start=self.iteration_start,
            pages=destroyed,
            damaged=damaged,
        )
        if fault.kind in _KILLED:
            self._die(fault)
        elif fault.kind is FaultKind.HANG:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind is FaultKind.EXCEPTION:
            raise InjectedFault(f"injected exception at {fault.text()}")
        elif fault.kind is FaultKind.SLOW:
            self._start_slow(fault, iteration)


def _ended(fault: FaultSpec) -> str:
    """The job store key that marks a slow fault with `until` ended (beside its fired key)."""
    return f"{fault.key}_ended"


def flip_byte(tensor, fault: FaultSpec) -> int:
    """Flip every bit of one byte in the middle of `tensor`'s storage (on its device);
    returns the byte offset."""
    import torch

    raw = tensor.view(-1).view(dtype=torch.uint8)
    offset = raw.numel() // 2
    raw[offset : offset + 1].bitwise_not_()
    return offset


def corrupt_newest_checkpoint(root: Path | None, fault: FaultSpec) -> str:
    """Flip one byte in the middle of the largest file of the newest complete checkpoint under
    `root` (its manifest then no longer matches); returns "path:offset".

    Raises:
        InjectedFault: no checkpoint to damage (the fault fired before the first was saved).
    """
    from unbroken.checkpoint import find_latest_valid

    info = find_latest_valid(root) if root is not None else None
    if info is None:
        raise InjectedFault(f"{fault.text()}: no complete checkpoint to damage yet")
    files = [f for f in info.path.iterdir() if f.is_file() and not f.name.startswith(".")]
    target = max((f for f in files if f.name != "manifest.json"), key=lambda f: f.stat().st_size)
    offset = target.stat().st_size // 2
    fd = os.open(target, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"{target}:{offset}"
