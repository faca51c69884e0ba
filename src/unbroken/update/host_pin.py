"""Host memory the device reads and writes: a retained host region registered with CUDA
(page-locked and mapped into the device's address space) for as long as its user lives.

The progress marker (written by stream kernels) and, on a GPU, the model's parity (read by the
fused update kernel and the codec, written back by copies) live in host memory the state
manager owns; the trainer maps that memory and registers it here. Registration is tied to the
user's lifetime, not the tensor's: freed host memory that stays registered poisons the next
allocation at its address (the likely cause of an asynchronous copy that failed with
`cudaErrorInvalidValue` on the H200, in `bench gpu` after a resumable trainer with host-allocated
marker pages was dropped). Pages the manager remapped after a loss are new memory at the same
address, which the old registration does not cover: `reregister` registers them again.

Hand-written because torch registers only memory it allocates (`pin_memory`); the calls are
`cudaHostRegister` / `cudaHostUnregister` through `torch.cuda.cudart()`.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HostRegistration", "register_host"]


def register_host(t: torch.Tensor) -> bool:
    """Make host tensor `t` addressable by CUDA kernels (pinned and mapped: the default flags
    under unified addressing). Returns False when it already was (nothing registered here).

    Raises:
        RuntimeError: the driver refused.
    """
    if t.is_pinned():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel()} host bytes failed (error {int(rc)})")
    return True


def _unregister_host(pages: torch.Tensor, device: torch.device) -> None:
    """Undo `register_host` once the device's work on `pages` has landed (held by the
    finalizer, which keeps `pages` alive until then)."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


class HostRegistration:
    """Keeps host tensor `pages` registered with CUDA while this object lives.

    Args:
        pages: a contiguous host tensor.
        device: the CUDA device whose work reads or writes it.
    """

    def __init__(self, pages: torch.Tensor, device: torch.device) -> None:
        if pages.device.type != "cpu" or not pages.is_contiguous():
            raise ValueError("only a contiguous host tensor can be registered with CUDA")
        self.pages = pages
        self.device = device
        self._registered = False
        self._unregister: weakref.finalize | None = None

    def ensure(self) -> None:
        """Register the pages unless they already are (idempotent, cheap when they are)."""
        if not self._registered:
            if register_host(self.pages):
                self._unregister = weakref.finalize(self, _unregister_host, self.pages, self.device)
                self._unregister.atexit = False  # the process's exit releases it anyway
            self._registered = True

    def reregister(self) -> None:
        """Register the pages again at the next `ensure` (after the manager remapped them)."""
        if self._unregister is not None:
            self._unregister()  # the old mapping's registration, once
            self._unregister = None
        self._registered = False
