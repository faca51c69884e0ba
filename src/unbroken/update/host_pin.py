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

Registrations are per process, as the driver keeps them: several users of one region (a test
building a second updater over the first one's regions) share one registration, counted in
`_users`, and the last of them to go unregisters it — one user's end never pulls the memory out
from under another.

Hand-written because torch registers only memory it allocates (`pin_memory`); the calls are
`cudaHostRegister` / `cudaHostUnregister` through `torch.cuda.cudart()`.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["DevicePointer", "HostRegistration", "register_host"]


class DevicePointer:
    """A raw device-accessible address (registered host memory is one under unified
    addressing) in the form Triton takes a pointer argument: Triton's launcher would refuse a
    CPU tensor by its type."""

    def __init__(self, address: int, dtype: torch.dtype = torch.uint8) -> None:
        self.dtype = dtype
        self._address = address

    def data_ptr(self) -> int:
        return self._address


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


_users: dict[int, int] = {}
"""Address of a region registered here -> its live `HostRegistration`s (this process's)."""


def _unregister_host(pages: torch.Tensor, device: torch.device) -> None:
    """Undo `register_host` once the device's work on `pages` has landed."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


def _acquire(pages: torch.Tensor) -> bool:
    """One more user of `pages`' registration, registering it if it is the first. False:
    memory torch pinned itself (nothing to release)."""
    address = pages.data_ptr()
    if address in _users:
        _users[address] += 1
        return True
    if register_host(pages):
        _users[address] = 1
        return True
    return False


def _release(pages: torch.Tensor, device: torch.device) -> None:
    """One user fewer; the last unregisters (held by the finalizer, which keeps `pages` alive
    until then)."""
    address = pages.data_ptr()
    if _users.get(address, 0) > 1:
        _users[address] -= 1
        return
    _users.pop(address, None)
    _unregister_host(pages, device)


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
            if _acquire(self.pages):
                self._unregister = weakref.finalize(self, _release, self.pages, self.device)
                self._unregister.atexit = False  # the process's exit releases it anyway
            self._registered = True

    def reregister(self) -> None:
        """Register the pages again now (after the manager remapped them: new memory at the
        same address, which the old registration does not cover); every user of the region
        keeps using the new registration. Registers them if they never were."""
        if self._unregister is None:
            self._registered = False
            self.ensure()
            return
        _unregister_host(self.pages, self.device)
        register_host(self.pages)
