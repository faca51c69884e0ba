"""The update phase without crash consistency: the same chunks and kernel as the resumable
updater (see [Note: chunk-geometry]), nothing retained around them. On a GPU the chunks run as
one fused launch over the whole state (`unbroken.update.fused_adamw`)."""

from __future__ import annotations

from unbroken.train.phases import Phase
from unbroken.train.state import TrainState
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_, fused_available
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
        decay_end = self.step.decay_end
        if s.params.is_cuda and decay_end is not None and fused_available():
            # Element-wise: one launch over every chunk computes the chunks' bits (see
            # fused_adamw). The chunks' hooks still fire, in order, before it.
            for k in range(n):
                hook(Phase.UPDATE, iteration, k, n)
            span = self.geometry.padded_numel
            coeffs = AdamWCoefficients.of(
                self.step.optimizer, step=iteration + 1, lr=lr, grad_scale=grad_scale
            )
            views = (t[:span] for t in (s.params, s.grads, s.exp_avg, s.exp_avg_sq))
            fused_adamw_(*views, coeffs, first_index=0, decay_end=decay_end)
            return
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
