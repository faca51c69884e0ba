"""Fires scheduled faults from inside a trainer, at phase hooks.

The injector is a phase hook. Before a fault acts, it marks it fired in the job store (so it
fires once per job, also across restarts) and appends a `failure_injected` event with the
wall-clock time, iteration and phase — that time is t_fault of the recovery metrics. It never
tells the recovery side where or what failed: detection and localization find that out
themselves.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch.distributed as dist

from unbroken.inject.faults import FaultKind, FaultSpec, InjectedFault
from unbroken.train.phases import Phase

__all__ = ["Injector"]


class Injector:
    """A phase hook that fires this rank's faults.

    Args:
        faults: the job's fault schedule (faults of other ranks are ignored).
        rank: this trainer's rank.
        store: the job store (not a generation prefix), shared by all generations.
        emit: appends an event to the job's event log.
        job_t0: wall time the job's first iteration started (for `at=` triggers).
    """

    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        store: dist.Store,
        emit: Callable[..., None],
        job_t0: float,
    ) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.store = store
        self.emit = emit
        self.job_t0 = job_t0
        self.iteration_start = time.time()
        self.slow_factor = 1.0
        self.page_loss = None
        """`pageloss` target: fault -> {region: pages destroyed} (set by in-place trainers)."""
        self._phase_start = time.perf_counter()

    def _fired(self, fault: FaultSpec) -> bool:
        return self.store.check([f"inject/{fault.key}"])

    def _matches(self, fault: FaultSpec, phase: Phase, it: int, step: int, n: int) -> bool:
        if fault.at_s is not None:
            return time.time() - self.job_t0 >= fault.at_s
        want_step = fault.step if fault.step is not None else n // 2
        return fault.iteration == it and fault.phase == phase and step == min(want_step, n - 1)

    def __call__(self, phase: Phase, iteration: int, step: int, n_steps: int) -> None:
        now = time.perf_counter()
        if self.slow_factor > 1.0:
            # Fail-slow: stall for (factor - 1) x the time the last phase step took, for real.
            time.sleep((self.slow_factor - 1.0) * (now - self._phase_start))
        if phase is Phase.FORWARD and step == 0:
            self.iteration_start = time.time()
        for fault in self.faults:
            if self._matches(fault, phase, iteration, step, n_steps) and not self._fired(fault):
                self._fire(fault, phase, iteration, step)
        self._phase_start = time.perf_counter()

    def _fire(self, fault: FaultSpec, phase: Phase, iteration: int, step: int) -> None:
        self.store.set(f"inject/{fault.key}", str(time.time()))
        destroyed = None
        if fault.kind is FaultKind.PAGELOSS:
            if self.page_loss is None:
                raise InjectedFault(f"{fault.text()}: no retained memory (recovery.mode)")
            destroyed = self.page_loss(fault)
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
        )
        if fault.kind in (FaultKind.KILL, FaultKind.PAGELOSS):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.HANG:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind is FaultKind.EXCEPTION:
            raise InjectedFault(f"injected exception at {fault.text()}")
        elif fault.kind is FaultKind.SLOW:
            self.slow_factor = fault.factor
