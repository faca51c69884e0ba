"""Retained GPU memory through the CUDA virtual-memory API (`cuda.bindings.driver`).

Why by hand: PyTorch's caching allocator and CUDA IPC tie an allocation's lifetime to the
process that made it (IPC) or to the allocator (torch), and neither can hand device memory to a
process that holds no CUDA context and keeps it alive across the trainer's death. The driver's
virtual-memory API does exactly that: `cuMemCreate` makes a physical allocation whose handle is
exported as a POSIX file descriptor; the allocation lives while any reference — a handle, a
mapping, or an exported fd — is open. So:

- the state manager (`unbroken.state.pool`) calls `create_allocation`: `cuInit` only, no context
  (PLATFORM-FACTS: cuMemCreate works without one, so the manager costs no GPU memory beyond the
  allocations), and keeps the allocation's handle — the handle is the whole ownership and costs
  no file descriptor;
- a trainer asks for the pages it maps in batches: the manager exports each handle as a POSIX
  fd (`export_fd`), passes the batch by SCM_RIGHTS and closes its copies; the trainer turns
  each fd back into a handle (`import_fd`, which closes the fd) and `DeviceMapping` maps the
  handles: reserve a virtual range, map, grant read/write to its device, and wrap the range
  zero-copy as a torch tensor (via ``__cuda_array_interface__``). A trainer killed at any
  moment leaves the allocation to the manager's handle; the next trainer maps it again and
  finds the bytes intact (measured on the H200: a 4-page allocation re-imported and mapped in
  0.08 s after SIGKILL of its creator).

Why handles and not fds in the manager: a retained page used to be held as its exported fd,
one per 2 MiB page, and the H200 machine's open-file limit (20,000, soft = hard) capped a state
manager near 40 GB. Handles have no such limit; fds exist only in flight, at most one batch
(`unbroken.state._wire.FDS_PER_MESSAGE`) per side at a time, so retention scales to the GPU.

Each page of a region is its own allocation (2 MiB, the granularity), so a page can be lost
alone: the manager and the trainer drop their references and the driver frees it; the next
trainer finds the hole (the manager holds no allocation for it), maps a new one there and the
updater rebuilds its contents from parity.
"""

from __future__ import annotations

import functools
from typing import Any

from unbroken.state.localize import page_runs

__all__ = [
    "CudaVmmError",
    "DeviceMapping",
    "available",
    "create_allocation",
    "export_fd",
    "granularity",
    "import_fd",
    "release",
]


class CudaVmmError(RuntimeError):
    """A driver call failed (the message names the call and the CUresult)."""


@functools.cache
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # cuda-python missing
        raise CudaVmmError(
            "retained GPU memory needs cuda-python (`pip install cuda-python`): "
            f"cannot import cuda.bindings.driver: {exc}"
        ) from exc
    _check(driver, "cuInit", driver.cuInit(0))
    return driver


def _check(drv, call: str, result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaVmmError(f"{call} failed: {err.name if hasattr(err, 'name') else err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def available() -> bool:
    """Whether the driver API is importable and at least one device is present."""
    try:
        drv = _driver()
        return (_check(drv, "cuDeviceGetCount", drv.cuDeviceGetCount()) or 0) > 0
    except CudaVmmError:
        return False


def _prop(drv, device: int):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = (
        drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def granularity(device: int) -> int:
    """The minimum allocation granularity on `device` in bytes (2 MiB on the H200)."""
    drv = _driver()
    return int(
        _check(
            drv,
            "cuMemGetAllocationGranularity",
            drv.cuMemGetAllocationGranularity(
                _prop(drv, device),
                drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            ),
        )
    )


def create_allocation(nbytes: int, device: int) -> Any:
    """Create `nbytes` of device memory on `device`; return its handle (the caller owns it:
    `release` drops it, and the memory goes once no process maps or holds it).

    `nbytes` must be a multiple of `granularity(device)`.

    Raises:
        CudaVmmError: the driver refused (out of memory, bad device, no VMM support).
    """
    drv = _driver()
    return _check(drv, "cuMemCreate", drv.cuMemCreate(nbytes, _prop(drv, device), 0))


def export_fd(handle: Any) -> int:
    """A new POSIX fd for the allocation behind `handle` (the caller closes it).

    Raises:
        CudaVmmError: the driver refused (the handle was released, out of fds).
    """
    drv = _driver()
    posix = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    fd = _check(
        drv, "cuMemExportToShareableHandle", drv.cuMemExportToShareableHandle(handle, posix, 0)
    )
    return int(fd)


def import_fd(fd: int) -> Any:
    """This process's handle to the allocation an exported `fd` names; closes `fd`.

    Raises:
        CudaVmmError: the fd is not an exported allocation.
    """
    import os

    drv = _driver()
    posix = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        return _check(
            drv, "cuMemImportFromShareableHandle", drv.cuMemImportFromShareableHandle(fd, posix)
        )
    finally:
        os.close(fd)


def release(handle: Any) -> None:
    """Drop this process's reference to an allocation (errors ignored: used on cleanup)."""
    _driver().cuMemRelease(handle)


class _ArrayInterface:
    """The minimal object `torch.as_tensor` wraps zero-copy: a CUDA array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class DeviceMapping:
    """A GPU region mapped into this process: one allocation per page, mapped side by side into
    one reserved virtual range and wrapped as one uint8 CUDA tensor.

    Args:
        handles: the present pages' allocations, in page order (imported with `import_fd`);
            the mapping owns them from here (released on unmap, or here if mapping fails).
        nbytes: the region's size, `page_bytes` x pages.
        page_bytes: size of each page's allocation.
        device: CUDA device ordinal the memory lives on (in this process's numbering, which
            the agent keeps equal to the manager's).
        missing: pages without an allocation (lost): their range stays reserved but unmapped
            (an access faults) until `map_pages` gives them new memory.

    Raises:
        CudaVmmError: import, reservation or mapping failed.
    """

    def __init__(
        self,
        handles: list[Any],
        nbytes: int,
        page_bytes: int,
        device: int,
        missing: list[int] | tuple[int, ...] = (),
    ) -> None:
        import torch

        drv = _driver()
        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)  # the primary context exists and is current
        self.nbytes, self.page_bytes, self.device = nbytes, page_bytes, device
        self._drv = drv
        self._handles: dict[int, Any] = {}
        self._ptr = None
        lost = set(missing)
        present = [p for p in range(nbytes // page_bytes) if p not in lost]
        if len(present) != len(handles):
            for handle in handles:
                release(handle)
            raise CudaVmmError(f"{len(handles)} allocations for {len(present)} present pages")
        try:
            self._ptr = _check(
                drv,
                "cuMemAddressReserve",
                drv.cuMemAddressReserve(nbytes, granularity(device), 0, 0),
            )
        except CudaVmmError:
            for handle in handles:
                release(handle)
            raise
        try:
            self.map_pages(present, handles)
        except CudaVmmError:
            self.close()
            raise
        self.tensor = torch.as_tensor(
            _ArrayInterface(int(self._ptr), nbytes), device=torch.device("cuda", device)
        )

    def map_pages(self, pages: list[int], handles: list[Any]) -> None:
        """Map each allocation `handles[i]` as page `pages[i]` (owning the handles from here:
        one that fails to map, and every one after it, is released)."""
        drv = self._drv
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        pending = list(zip(pages, handles, strict=True))
        for i, (page, handle) in enumerate(pending):
            at = int(self._ptr) + page * self.page_bytes
            try:
                _check(drv, "cuMemMap", drv.cuMemMap(at, self.page_bytes, 0, handle, 0))
            except CudaVmmError:
                for _, left in pending[i:]:
                    release(left)
                raise
            self._handles[page] = handle
        # Access is granted per run of consecutive pages: one driver call per run, not per page
        # (a 100 GB region is 51,200 pages, mostly one run).
        for first, count in page_runs(sorted(pages)):
            at = int(self._ptr) + first * self.page_bytes
            size = count * self.page_bytes
            _check(drv, "cuMemSetAccess", drv.cuMemSetAccess(at, size, [access], 1))

    def mapped_pages(self) -> list[int]:
        """The pages this mapping holds an allocation for, ascending."""
        return sorted(self._handles)

    def unmap_pages(self, pages: list[int]) -> None:
        """Unmap `pages` and drop this process's reference to their memory (with the
        manager's dropped too, the driver frees it: a lost page; an access then faults)."""
        drv = self._drv
        for page in pages:
            handle = self._handles.pop(page, None)
            if handle is not None:
                at = int(self._ptr) + page * self.page_bytes
                _check(drv, "cuMemUnmap", drv.cuMemUnmap(at, self.page_bytes))
                drv.cuMemRelease(handle)

    def close(self) -> None:
        """Unmap everything and free the range (the manager's handles keep the memory). Views of
        `tensor` must be gone and the device idle for these bytes first."""
        self.tensor = None
        self.unmap_pages(list(self._handles))
        if self._ptr is not None:
            self._drv.cuMemAddressFree(self._ptr, self.nbytes)
            self._ptr = None
