"""The update phase without crash consistency: the same chunks and kernel as the resumable
updater (see [Note: chunk-geometry]), nothing retained around them."""

from __future__ import annotations

from unbroken.train.phases import Phase
from unbroken.train.state import TrainState
from unbroken.update.geometry import StateGeometry
from unbroken.update.kernel import ChunkStep

__all__ = ["PlainUpdater"]


class PlainUpdater:
    def __init__(self, state: TrainState, geometry: StateGeometry, step: ChunkStep) -> None:
        self.state = state
        self.geometry = geometry
        self.step = step
        self.chunks = geometry.chunks()

    def protect(self, iteration: int) -> None:
        """Nothing to protect."""

    def record_sync(self, iteration: int, **stats: float) -> None:
        """Nothing to record."""

    def update(self, iteration: int, *, lr: float, grad_scale: float, hook) -> None:
        s, n = self.state, len(self.chunks)
        for k, ref in enumerate(self.chunks):
            hook(Phase.UPDATE, iteration, k, n)
            self.step(
                ref,
                s.params,
                s.grads,
                s.exp_avg,
                s.exp_avg_sq,
                step=iteration + 1,
                lr=lr,
                grad_scale=grad_scale,
            )

    def boundary(self, iteration: int) -> None:
        """Nothing to finish."""
