"""Zero-copy access to the page buffers callers hand in: numpy arrays, torch tensors (CPU or
CUDA), bytearrays and writable memoryviews. Never copies; rejects what it cannot view in place.

A `PageTable` resolves a list of pages to raw addresses once; slicing and selecting pages of a
table is pointer arithmetic, so the per-iteration hot path (the same retained pages, a moving
byte range) pays no per-page Python cost. torch is not imported here: a tensor is recognised by
its methods, so the CPU codec works in processes that never load torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Buffer", "PageTable", "as_numpy", "device_of"]

Buffer = Any
"""A page buffer: numpy array, torch tensor, bytearray or memoryview (contiguous)."""


def _is_tensor(buf: Any) -> bool:
    return hasattr(buf, "data_ptr") and hasattr(buf, "element_size") and hasattr(buf, "device")


def device_of(buf: Any) -> str:
    """Return ``"cpu"`` or the CUDA device (``"cuda:N"``) that holds the buffer."""
    if _is_tensor(buf):
        dev = buf.device
        return "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    return "cpu"


def as_numpy(buf: Any) -> np.ndarray:
    """Return a 1-D uint8 numpy view of a CPU buffer without copying.

    Raises:
        TypeError: for non-contiguous or device buffers.
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TypeError("erasure: page arrays must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    if _is_tensor(buf):
        if buf.device.type != "cpu":
            raise TypeError(f"erasure: expected a CPU buffer, got one on {buf.device}")
        if not buf.is_contiguous():
            raise TypeError("erasure: page tensors must be contiguous")
        flat = buf.detach().reshape(-1)
        return np.ctypeslib.as_array(
            (ctypes.c_uint8 * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
        )
    if isinstance(buf, (bytearray, memoryview, bytes)):
        view = memoryview(buf)
        if not view.contiguous:
            raise TypeError("erasure: page memoryviews must be contiguous")
        return np.frombuffer(view.cast("B"), dtype=np.uint8)
    raise TypeError(f"erasure: unsupported page buffer type {type(buf).__name__}")


def _resolve(buf: Any) -> tuple[int, int, str, bool, Any]:
    """(address, nbytes, device, writable, owner) of one buffer."""
    if type(buf) is np.ndarray:
        flags = buf.flags
        if not flags.c_contiguous:
            raise TypeError("erasure: page arrays must be C-contiguous")
        return buf.__array_interface__["data"][0], buf.nbytes, "cpu", flags.writeable, buf
    if _is_tensor(buf):
        if not buf.is_contiguous():
            raise TypeError("erasure: page tensors must be contiguous")
        if buf.dtype.is_complex or buf.is_sparse:
            raise TypeError("erasure: page tensors must be dense real tensors")
        return buf.data_ptr(), buf.numel() * buf.element_size(), device_of(buf), True, buf
    array = as_numpy(buf)
    return array.__array_interface__["data"][0], array.nbytes, "cpu", array.flags.writeable, array


class PageTable:
    """Equal-length pages on one device, resolved to raw addresses once.

    Build one per set of retained pages and reuse it every iteration; `slice` and `take` derive
    tables of byte ranges or page subsets without touching Python objects per page.

    Args:
        pages: the page buffers (all on one device; all of one length).

    Raises:
        TypeError: an unsupported or non-contiguous buffer.
        ValueError: pages on different devices or of different lengths.
    """

    __slots__ = ("device", "owners", "page_bytes", "ptrs", "writable")

    def __init__(self, pages: Sequence[Buffer]) -> None:
        resolved = [_resolve(page) for page in pages]
        devices = {r[2] for r in resolved}
        lengths = {r[1] for r in resolved}
        if len(devices) > 1:
            raise ValueError(f"erasure: pages of one table lie on several devices: {devices}")
        if len(lengths) > 1:
            raise ValueError(f"erasure: pages of one table differ in length: {sorted(lengths)}")
        self.ptrs = np.fromiter((r[0] for r in resolved), dtype=np.uint64, count=len(resolved))
        self.page_bytes = lengths.pop() if lengths else 0
        self.device = devices.pop() if devices else "cpu"
        self.writable = all(r[3] for r in resolved)
        self.owners: tuple[Any, ...] = tuple(r[4] for r in resolved)

    @classmethod
    def _derived(
        cls, parent: PageTable, ptrs: np.ndarray, page_bytes: int, owners: tuple[Any, ...]
    ) -> PageTable:
        table = cls.__new__(cls)
        table.ptrs = ptrs
        table.page_bytes = page_bytes
        table.device = parent.device
        table.writable = parent.writable
        table.owners = owners
        return table

    def mapped_into(self, device: str) -> PageTable:
        """This table of host pages as pages of CUDA `device`: the same addresses, which the
        device reaches because the caller registered the memory with CUDA (pinned and mapped,
        under unified addressing) and keeps it registered while the table is used. A codec on
        that device then reads and writes the host pages in place (the model's parity in host
        memory, `unbroken.update.host_pin`).

        Raises:
            ValueError: pages that are not host pages, or a device that is not CUDA.
        """
        if self.device != "cpu" or not device.startswith("cuda"):
            raise ValueError(f"erasure: only host pages map into a CUDA device, not {self!r}")
        table = PageTable._derived(self, self.ptrs, self.page_bytes, self.owners)
        table.device = device
        return table

    @classmethod
    def from_rows(cls, array: Buffer) -> PageTable:
        """A table whose pages are the rows of a C-contiguous 2-D array or tensor.

        Args:
            array: shape (pages, bytes-per-page in any dtype), C-contiguous.
        """
        whole = cls([array])
        rows = int(array.shape[0])
        if rows == 0:
            return cls._derived(whole, np.zeros(0, dtype=np.uint64), 0, whole.owners)
        pitch = whole.page_bytes // rows
        ptrs = whole.ptrs[0] + np.arange(rows, dtype=np.uint64) * np.uint64(pitch)
        return cls._derived(whole, ptrs, pitch, whole.owners)

    @classmethod
    def concat(cls, tables: Sequence[PageTable]) -> PageTable:
        """One table of the pages of several (same device, same page length)."""
        tables = [t for t in tables if len(t)]
        if not tables:
            return cls([])
        if len({t.device for t in tables}) > 1 or len({t.page_bytes for t in tables}) > 1:
            raise ValueError("erasure: cannot join pages of different devices or lengths")
        table = cls._derived(
            tables[0],
            np.concatenate([t.ptrs for t in tables]),
            tables[0].page_bytes,
            tuple(o for t in tables for o in t.owners),
        )
        table.writable = all(t.writable for t in tables)
        return table

    def slice(self, offset: int, length: int) -> PageTable:
        """The byte range [offset, offset + length) of every page."""
        if offset < 0 or length < 0 or offset + length > self.page_bytes:
            raise ValueError(
                f"erasure: byte range [{offset}, {offset + length}) outside pages of "
                f"{self.page_bytes} bytes"
            )
        return PageTable._derived(self, self.ptrs + np.uint64(offset), length, self.owners)

    def take(self, indices: Sequence[int]) -> PageTable:
        """The pages at ``indices``, in that order."""
        return PageTable._derived(
            self, self.ptrs[np.asarray(indices, dtype=np.int64)], self.page_bytes, self.owners
        )

    def __len__(self) -> int:
        return len(self.ptrs)

    def __repr__(self) -> str:
        return f"PageTable(pages={len(self)}, page_bytes={self.page_bytes}, device={self.device!r})"

    def numpy_views(self) -> list[np.ndarray]:
        """Writable uint8 numpy views of CPU pages (for the reference backend)."""
        if self.device != "cpu":
            raise TypeError(f"erasure: pages on {self.device} have no numpy view")
        n = self.page_bytes
        return [
            np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(p)))
            if n
            else np.zeros(0, np.uint8)
            for p in self.ptrs
        ]
