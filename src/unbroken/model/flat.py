"""Parameters as views into one flat buffer that the caller owns.

`FlatLayout.of(model)` gives every parameter a slot (name, shape, offset) in a fixed order:
weight-decayed tensors (ndim >= 2) first, then the rest (norm weights), so an optimizer can
update any element range [a, b) and know its decay from one boundary (`decay_end`). Offsets
are aligned to 16 elements (64 bytes for fp32). `materialize(model, flat)` replaces every
parameter of a (meta-device) model with a view of `flat`; the same layout describes gradients,
optimizer moments and master weights, each in its own flat buffer of `layout.numel` elements.

[Note: flat-storage] Nothing in the trainer may reallocate a parameter or its `.grad`: every
component that touches model state (optimizer, checkpoint, erasure protection, recovery) works
on the flat buffers, and the module's tensors are only views of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlatLayout", "ParamSlot", "bind_grads", "init_parameters", "materialize"]

_ALIGN = 16


@dataclass(frozen=True, slots=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    decay: bool


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer of `numel` elements."""

    slots: tuple[ParamSlot, ...]
    numel: int
    decay_end: int
    """Elements [0, decay_end) get weight decay; [decay_end, numel) do not."""

    @classmethod
    def of(cls, model: nn.Module) -> FlatLayout:
        named = list(model.named_parameters())
        ordered = [p for p in named if p[1].ndim >= 2] + [p for p in named if p[1].ndim < 2]
        slots, offset, decay_end = [], 0, 0
        for name, p in ordered:
            decay = p.ndim >= 2
            if not decay and decay_end == 0:
                decay_end = offset
            slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel(), decay))
            offset += -(-p.numel() // _ALIGN) * _ALIGN
        if all(s.decay for s in slots):
            decay_end = offset
        return cls(slots=tuple(slots), numel=offset, decay_end=decay_end)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view of `flat` shaped like the parameter."""
        if flat.numel() < self.numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.numel}")
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def materialize(model: nn.Module, layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make every parameter of `model` a view into `flat` (contents are left as they are)."""
    views = layout.views(flat)
    for slot in layout.slots:
        module, leaf = _owner(model, slot.name)
        module._parameters[leaf] = nn.Parameter(views[slot.name], requires_grad=True)


def bind_grads(model: nn.Module, layout: FlatLayout, grad_flat: torch.Tensor) -> None:
    """Point every parameter's `.grad` at its slot of `grad_flat` (autograd accumulates there)."""
    views = layout.views(grad_flat)
    for name, p in model.named_parameters():
        p.grad = views[name]


def init_parameters(layout: FlatLayout, flat: torch.Tensor, *, std: float, seed: int) -> None:
    """Deterministic init: N(0, std^2) for matrices, ones for norm weights, zeros in padding.

    Drawn on the CPU in layout order from one generator, then copied, so the initial state is
    identical on every device and process.
    """
    gen = torch.Generator().manual_seed(seed)
    host = torch.zeros(layout.numel, dtype=torch.float32)
    for slot in layout.slots:
        view = host[slot.offset : slot.offset + slot.numel]
        if slot.decay:
            view.normal_(0.0, std, generator=gen)
        else:
            view.fill_(1.0)
    flat[: layout.numel].copy_(host)
