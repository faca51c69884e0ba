"""The iteration's tail, written once for every executor: protect → sync → record → update →
boundary (ARCHITECTURE.md, "One iteration", steps 2-5).

The data-parallel `Trainer` and the hybrid-parallel engine's `PlanWorker` differ in how they
compute gradients and how they agree on the loss and the gradient norm (`sync`); what follows
the compute phase is the same contract, and it is here: the gradients are protected before any
rank may pass the global synchronization, the agreed statistics are recorded before the first
chunk is updated, and the updater runs (or resumes) its chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from unbroken.config import TrainConfig
from unbroken.train.optim import lr_at
from unbroken.train.phases import Phase, PhaseHook

__all__ = ["SyncedStats", "Updater", "finish_iteration"]


class Updater(Protocol):
    """The update phase over flat state (`unbroken.update.PlainUpdater`, or the resumable
    updater of in-place recovery, `unbroken.update.rmu.ResumableUpdater`)."""

    def protect(self, iteration: int) -> None:
        """Protect the gradients of `iteration` (before the global synchronization)."""

    def record_sync(
        self, iteration: int, *, loss: float, grad_norm: float, grad_scale: float, lr: float
    ) -> None:
        """Record the synchronized statistics the update will use."""

    def update(self, iteration: int, *, lr: float, grad_scale: float, hook: PhaseHook) -> None:
        """Run (or resume) the update of `iteration`, chunk by chunk."""

    def boundary(self, iteration: int) -> None:
        """Finish the iteration (the state is at the boundary after it)."""


@dataclass(frozen=True, slots=True)
class SyncedStats:
    loss: float
    grad_norm: float
    grad_scale: float
    lr: float


def finish_iteration(
    updater: Updater,
    hook: PhaseHook,
    cfg: TrainConfig,
    iteration: int,
    sync: Callable[[], tuple[float, float, float]],
) -> SyncedStats:
    """The tail of `iteration` after its compute phase.

    Args:
        updater: runs the update phase.
        hook: the executor's phase hooks (called as `hook(phase, iteration, step, n_steps)`).
        cfg: the learning-rate schedule.
        iteration: the iteration.
        sync: the executor's global synchronization, returning (loss, grad_norm, clip factor).
    """
    hook(Phase.PROTECT, iteration, 0, 1)
    updater.protect(iteration)
    loss, norm, scale = sync()
    lr = lr_at(cfg, iteration)
    updater.record_sync(iteration, loss=loss, grad_norm=norm, grad_scale=scale, lr=lr)
    with torch.no_grad():
        updater.update(iteration, lr=lr, grad_scale=scale, hook=hook)
    hook(Phase.BOUNDARY, iteration, 0, 1)
    updater.boundary(iteration)
    return SyncedStats(loss, norm, scale, lr)
