"""Flat training state: parameters, gradients and AdamW moments in caller-provided buffers.

By default the buffers are ordinary tensors; the state manager (in-place recovery) passes its
retained memory instead. See [Note: flat-storage] in unbroken.model.flat.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from unbroken.model.flat import FlatLayout
from unbroken.train.digest import device_digest

__all__ = ["TrainState"]


@dataclass(slots=True)
class TrainState:
    layout: FlatLayout
    params: torch.Tensor
    grads: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @classmethod
    def allocate(
        cls, layout: FlatLayout, device: torch.device | str = "cpu", numel: int | None = None
    ) -> TrainState:
        """Fresh zeroed buffers of `numel` elements each (default: the layout's, unpadded)."""
        n = numel if numel is not None else layout.numel

        def buf() -> torch.Tensor:
            return torch.zeros(n, dtype=torch.float32, device=device)

        return cls(layout, buf(), buf(), buf(), buf())

    def persistent(self) -> dict[str, torch.Tensor]:
        """The tensors that define the model state across iterations (not the gradients)."""
        return {"params": self.params, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def state_hash(self) -> str:
        """sha256 over the bytes of parameters and moments, in a fixed order (hex, 16 chars).
        State on a GPU is fingerprinted there first (`unbroken.train.digest`) instead of being
        copied to the host every hashed iteration; a CPU state's hash is sha256 of its bytes."""
        h = hashlib.sha256()
        for t in self.persistent().values():
            if t.is_cuda:
                h.update(device_digest(t))
            else:
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        return h.hexdigest()[:16]
