"""The update phase without crash consistency: the same chunks and kernel as the resumable
updater (see [Note: chunk-geometry]), nothing retained around them. On a GPU, AdamW runs the
chunks as one fused launch over the whole state (`unbroken.update.fused_adamw`); the other
rules run their chunks with torch operations."""

from __future__ import annotations

from unbroken.train.phases import Phase
from unbroken.train.state import TrainState
from unbroken.update.adamw import AdamWRule
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
        s, n, passes = self.state, len(self.chunks), self.step.passes
        decay_end = self.step.decay_end
        fused = isinstance(self.step.rule, AdamWRule) and decay_end is not None
        if s.params.is_cuda and fused and fused_available():
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
        scalars = {"step": iteration + 1, "lr": lr, "grad_scale": grad_scale}
        for pass_ in range(passes):
            self.step.begin_pass(pass_, s, **scalars)
            for k, ref in enumerate(self.chunks):
                hook(Phase.UPDATE, iteration, pass_ * n + k, passes * n)
                self.step(ref, s.params, s.grads, s.exp_avg, s.exp_avg_sq, pass_=pass_, **scalars)

    def boundary(self, iteration: int) -> None:
        """Nothing to finish."""
