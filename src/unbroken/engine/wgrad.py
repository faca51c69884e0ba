"""Deferred weight gradients for the split backward of zero-bubble schedules (ZB-H1's B and W).

[Note: split backward] B runs the ordinary backward of a stage, except that every
`SplitLinear` whose `WeightGradSink` is open returns no weight gradient and leaves
(weight, input, output-gradient) in the sink instead; W then runs those weight-gradient GEMMs and
accumulates them into the parameters' `.grad` (views of the flat gradient buffer). So B computes
exactly the input gradient plus the cheap parameter gradients (norm weights, embedding rows), W
the weight GEMMs — the B/W split of the zero-bubble paper, with no second walk of the graph.

With the sink closed (every schedule but ZB-H1, and a ZB-H1 B without a W), `SplitLinear` is
`F.linear`'s autograd: forward ``x @ w.T``, backward — the same
GEMMs as torch's own linear backward (``g @ w`` and ``g.T @ x``), so TP-1 stages keep the
reference model's bits.

Under autocast the inputs are cast as `F.linear` would be (to the autocast dtype); the deferred
gradient is cast back to the parameter's dtype when W accumulates it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SplitLinear", "WeightGradSink"]


class WeightGradSink:
    """Where open B's leave their weight-gradient work; one per `StageModel`, never global."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] | None = None

    def open(self) -> list:
        """Start collecting (the caller runs B's backward next) and return the list."""
        self.pending = []
        return self.pending

    def close(self) -> None:
        self.pending = None

    @staticmethod
    @torch.no_grad()
    def run(work: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]) -> None:
        """W: the weight GEMMs of one (stage, micro-batch), accumulated into `.grad`."""
        for weight, x, g in work:
            gw = g.t().mm(x)
            if gw.dtype != weight.dtype:
                gw = gw.to(weight.dtype)
            if weight.grad is None:
                weight.grad = gw.clone()
            else:
                weight.grad += gw


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x.mm(weight.t())

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.mm(weight)
        sink = ctx.module.sink
        if sink.pending is not None:
            sink.pending.append((ctx.module.weight, x, g))
            return gx, None, None
        # torch's mm backward for a transposed (column-major) mat2 = weight.t(): g.t() @ x
        return gx, g.t().mm(x), None


class SplitLinear(nn.Linear):
    """`nn.Linear` without bias on 2-D inputs whose weight gradient can be deferred to W."""

    def __init__(self, in_features: int, out_features: int, sink: WeightGradSink, device=None):
        super().__init__(in_features, out_features, bias=False, device=device)
        self.sink = sink

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_weight(x, self.weight)

    def with_weight(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This linear with weight `w`: its own, or a TP position's shard of it when a stage
        computes as a wider TP group (`unbroken.engine.emulate`; the sink must be closed
        then, since a deferred gradient would go to the whole weight)."""
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            with torch.autocast(x.device.type, enabled=False):
                return _LinearFn.apply(x.to(dtype), w.to(dtype), self)
        return _LinearFn.apply(x, w, self)
