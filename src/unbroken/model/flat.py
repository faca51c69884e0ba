"""Parameters as views into one flat buffer that the caller owns.

`FlatLayout.of(model)` gives every parameter a slot (name, shape, offset) in a fixed order:
matrices (ndim >= 2) first, then the rest (norm weights, biases), each in the model's own order.
Offsets are aligned to 16 elements (64 bytes for fp32). `materialize(model, layout, flat)`
replaces every parameter of a (meta-device) model with a view of `flat`; the same layout
describes gradients, optimizer moments and master weights, each in its own flat buffer of
`layout.numel` elements.

[Note: flat-storage] Nothing in the trainer may reallocate a parameter or its `.grad`: every
component that touches model state (optimizer, checkpoint, erasure protection, recovery) works
on the flat buffers, and the module's tensors are only views of them.

[Note: shared parameters] What a slot records besides its place:

- *aliases*: one parameter reachable under several names (tied embedding and head, a module
  used twice) has one slot; its other names are the slot's `aliases`, and `materialize` puts
  the same `nn.Parameter` under every name. So it is stored, updated, protected and
  checkpointed once, and its gradient (autograd sums both uses) lands in one place.
- *copies*: a parameter whose owner lives in another rank's layout but that this rank also
  needs (the tied head on a pipeline's last stage, whose owner is the embedding on the first
  stage; Megatron's shared embedding) is a slot of `copies`, not of `slots`. It is stored,
  updated and protected here like any slot; code that must count each parameter once across
  ranks (the global gradient norm) reads `slots` only. Keeping a copy equal to its owner is the
  job of whoever builds the layout (`unbroken.engine.tied` sums the two gradients).
- *trainable*: `requires_grad=False` parameters are kept, checkpointed and restored with the
  rest but get no gradient and no update (`frozen_ranges`).
- *decay*: decoupled weight decay applies to trainable matrices unless one of the parameter's
  names (or of the names it is tied to) matches a `no_decay` pattern (`fnmatch`, e.g.
  ``"embed.*"``); vectors (norm weights, biases) never decay. The optimizer reads it as element
  ranges (`decay_ranges`), so the layout order never depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

__all__ = [
    "FlatLayout",
    "ParamSlot",
    "bind_grads",
    "init_parameters",
    "matches_any",
    "materialize",
]

_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def matches_any(names: Iterable[str], patterns: Sequence[str]) -> bool:
    """Whether any of `names` matches any `fnmatch` pattern of `patterns` (case-sensitive)."""
    return any(fnmatchcase(n, p) for n in names for p in patterns)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    decay: bool
    trainable: bool = True
    """False for a frozen parameter (`requires_grad=False`): stored, never updated."""
    aliases: tuple[str, ...] = ()
    """The parameter's other names in the same module (tied weights, a module used twice)."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def end(self) -> int:
        """End of the slot's aligned span (its padding included)."""
        return self.offset + _aligned(self.numel)


def _merged(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer of `numel` elements ([Note: shared
    parameters])."""

    slots: tuple[ParamSlot, ...]
    numel: int
    copies: tuple[ParamSlot, ...] = ()
    """Local copies of parameters another rank's layout owns; stored like slots (after all of
    them, so a range merged over `slots` never spans a copy), not counted as parameters of
    this layout."""

    @classmethod
    def of(
        cls,
        model: nn.Module,
        *,
        no_decay: Sequence[str] = (),
        tied: Sequence[Sequence[str]] = (),
    ) -> FlatLayout:
        """The layout of `model`'s parameters.

        Args:
            model: the module (on any device, "meta" included).
            no_decay: `fnmatch` patterns of parameter names that get no weight decay.
            tied: groups of names that are one parameter of the whole model, the owner's name
                first. A member present here without its owner becomes a copy; the decay rule
                sees every name of the group, so each holder decides alike.
        """
        groups = {name: tuple(g) for g in tied for name in g}
        by_id: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            params[id(p)] = p
        present = {n for names in by_id.values() for n in names}
        owned = [i for i in by_id if groups.get(by_id[i][0], by_id[i])[0] in present]
        order = [i for i in owned if params[i].ndim >= 2] + [i for i in owned if params[i].ndim < 2]
        n_owned, owned_ids = len(order), set(owned)
        order += [i for i in by_id if i not in owned_ids]  # copies last: see `copies`
        slots, offset = [], 0
        for i in order:
            p, names = params[i], by_id[i]
            related = sorted({n for name in names for n in groups.get(name, (name,))})
            trainable = bool(p.requires_grad)
            decay = trainable and p.ndim >= 2 and not matches_any(related, no_decay)
            slots.append(
                ParamSlot(
                    names[0], tuple(p.shape), offset, p.numel(), decay, trainable, tuple(names[1:])
                )
            )
            offset = slots[-1].end
        copies = slots[n_owned:]
        slots = slots[:n_owned]
        return cls(slots=tuple(slots), numel=offset, copies=tuple(copies))

    @property
    def stored(self) -> tuple[ParamSlot, ...]:
        """Every slot with storage in the buffer: `slots`, then `copies`."""
        return self.slots + self.copies

    def decay_ranges(self) -> tuple[tuple[int, int], ...]:
        """Sorted, merged element ranges [a, b) that get weight decay (padding included)."""
        return _merged((s.offset, s.end) for s in self.stored if s.decay)

    def frozen_ranges(self) -> tuple[tuple[int, int], ...]:
        """Sorted, merged element ranges [a, b) of frozen parameters (never updated)."""
        return _merged((s.offset, s.end) for s in self.stored if not s.trainable)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view of `flat` shaped like the parameter, for every name (aliases and
        copies included; aliases share one view's memory)."""
        if flat.numel() < self.numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.numel}")
        out = {}
        for s in self.stored:
            view = flat[s.offset : s.offset + s.numel].view(s.shape)
            out.update(dict.fromkeys(s.names, view))
        return out


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def materialize(model: nn.Module, layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make every parameter of `model` a view into `flat` (contents are left as they are).

    Every name of a slot gets the same `nn.Parameter`, so tied weights stay tied; frozen slots
    get `requires_grad=False`.

    Raises:
        ValueError: the model has parameters the layout does not name.
    """
    views = layout.views(flat)
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in views]
    if missing:
        raise ValueError(f"parameters not in the flat layout: {missing[:5]}")
    for slot in layout.stored:
        param = nn.Parameter(views[slot.name], requires_grad=slot.trainable)
        for name in slot.names:
            module, leaf = _owner(model, name)
            module._parameters[leaf] = param


def bind_grads(model: nn.Module, layout: FlatLayout, grad_flat: torch.Tensor) -> None:
    """Point every trainable parameter's `.grad` at its slot of `grad_flat` (autograd
    accumulates there); frozen parameters get none, so their gradient slots stay zero."""
    views = layout.views(grad_flat)
    for slot in layout.stored:
        if slot.trainable:
            model.get_parameter(slot.name).grad = views[slot.name]


def init_parameters(layout: FlatLayout, flat: torch.Tensor, *, std: float, seed: int) -> None:
    """Deterministic init: N(0, std^2) for matrices, ones for vectors, zeros in padding.

    Drawn on the CPU in layout order from one generator, then copied, so the initial state is
    identical on every device and process.
    """
    gen = torch.Generator().manual_seed(seed)
    host = torch.zeros(layout.numel, dtype=torch.float32)
    for slot in layout.stored:
        view = host[slot.offset : slot.offset + slot.numel]
        if len(slot.shape) >= 2:
            view.normal_(0.0, std, generator=gen)
        else:
            view.fill_(1.0)
    flat[: layout.numel].copy_(host)
