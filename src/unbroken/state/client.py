"""Trainer side of the Resilient Memory Pool: connect, get regions, map them zero-copy.

`RetainedClient` talks to this rank's state manager (`unbroken.state.manager`); each region
is mapped once and wrapped without a copy as a `torch.uint8` tensor: a host region (its memfd,
passed by SCM_RIGHTS) with `mmap(MAP_SHARED)`, a GPU region (one CUDA allocation per page,
fetched in batches of exported fds, each imported as a handle and closed at once, so the
client's fd use stays bounded) through the driver's virtual-memory API
(`unbroken.state.cuda_vmm`) as a CUDA tensor. The client owns its mappings; closing them never affects the retained memory, which
the manager owns.

A fresh host region is backed by zeros from its creation (no holes); a fresh GPU region's
contents are undefined, so trainers write every fresh region (``region.tensor.zero_()``). They
must not touch retained pages after a failure before `localize` has run ([Note: localize before touching] in
`unbroken.state.localize`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unbroken.state._wire import FDS_PER_MESSAGE, FrameError, recv_reply, send_frame

__all__ = ["LocalizationReport", "RetainedClient", "RetainedRegion", "RetainedStateError"]


class RetainedStateError(Exception):
    """The state manager refused a request or could not be reached (message says why)."""


@dataclass(frozen=True, slots=True)
class LocalizationReport:
    """Missing pages per region, as found by the manager.

    Attributes:
        lost: region name -> ascending indices of missing pages (empty list: intact).
        ms: time the manager spent localizing, in milliseconds.
    """

    lost: dict[str, list[int]]
    ms: float

    @property
    def total(self) -> int:
        """Number of missing pages over all regions."""
        return sum(len(pages) for pages in self.lost.values())


class RetainedRegion:
    """One retained region, mapped once into this process.

    Attributes:
        name: region name.
        nbytes: size in bytes (the requested size rounded up to whole pages).
        page_bytes: page size; the unit of loss, localization and remap.
        protected: whether parity covers the contents.
        fresh: True when the contents are new (zeros), False when retained from earlier.
        device: CUDA device ordinal of a GPU region, None for host memory.
        serial: the manager's creation number of the region.
        fd: this process's copy of the region's memfd (host regions; -1 for GPU regions,
            whose fd is closed once imported).
        tensor: a zero-copy `torch.uint8` tensor over the whole mapping.
    """

    def __init__(
        self, info: dict[str, Any], fds: list[int], handles: list[Any] | None = None
    ) -> None:
        self.name: str = info["name"]
        self.nbytes: int = info["nbytes"]
        self.page_bytes: int = info["page_bytes"]
        self.protected: bool = info["protected"]
        self.fresh: bool = info["fresh"]
        self.device: int | None = info.get("device")
        self.serial: int = info.get("serial", 0)
        self.remaps: int = info.get("remaps", 0)
        self._mmap = self._gpu = None
        if self.device is None:
            (fd,) = fds
            self.fd = fd
            self._mmap = mmap.mmap(
                fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
            self.tensor: torch.Tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            from unbroken.state.cuda_vmm import DeviceMapping

            self.fd = -1
            self._gpu = DeviceMapping(
                handles or [], self.nbytes, self.page_bytes, self.device, info.get("missing", ())
            )  # owns the handles
            self.tensor = self._gpu.tensor

    @property
    def n_pages(self) -> int:
        """Number of pages in the region."""
        return self.nbytes // self.page_bytes

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole region as a flat tensor of `dtype` (zero-copy)."""
        return self.tensor.view(dtype)

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as a zero-copy uint8 view.

        Raises:
            IndexError: `index` outside [0, n_pages).
        """
        if not 0 <= index < self.n_pages:
            raise IndexError(f"page {index} outside region {self.name!r} of {self.n_pages} pages")
        start = index * self.page_bytes
        return self.tensor[start : start + self.page_bytes]

    def map_pages(self, pages: list[int], handles: list[Any]) -> None:
        """GPU regions: map new allocations (imported `handles`, owned from here) as `pages`
        (after a remap)."""
        assert self._gpu is not None, "host regions are remapped in place by the manager"
        self._gpu.map_pages(pages, handles)

    def mapped_pages(self) -> list[int]:
        """GPU regions: the pages this process maps an allocation at (host regions: every
        page, the memfd's)."""
        if self._gpu is None:
            return list(range(self.n_pages))
        return self._gpu.mapped_pages()

    def unmap_pages(self, pages: list[int]) -> None:
        """GPU regions: drop this process's mapping of `pages` (page-loss injection: with the
        manager's allocation discarded too, the memory is gone; an access faults)."""
        assert self._gpu is not None, "host pages are lost by punching holes (pageloss.py)"
        torch.cuda.synchronize(self.device)
        self._gpu.unmap_pages(pages)

    def close(self) -> None:
        """Unmap and close the fd. Views of `tensor` must be gone first."""
        self.tensor = None  # type: ignore[assignment]
        if self._gpu is not None:
            torch.cuda.synchronize(self.device)
            self._gpu.close()
            return
        with contextlib.suppress(BufferError):
            self._mmap.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __repr__(self) -> str:
        return (
            f"RetainedRegion({self.name!r}, nbytes={self.nbytes}, page_bytes={self.page_bytes},"
            f" protected={self.protected}, fresh={self.fresh})"
        )


class RetainedClient:
    """A connection to one rank's state manager.

    Not thread-safe: one request is in flight at a time (the fds that arrive with a reply are
    matched to it by order). Regions are mapped once per client; allocating or attaching a
    region this client already maps returns the same `RetainedRegion`.

    Args:
        socket_path: the manager's socket.
        timeout_s: how long to wait for the socket to appear and for each reply.
        generation: the job generation this client belongs to, sent with every request: the
            manager refuses requests of a generation older than the newest it has served.

    Raises:
        RetainedStateError: no manager answered at `socket_path` within `timeout_s`.
    """

    def __init__(
        self, socket_path: str | Path, timeout_s: float = 10.0, generation: int | None = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.socket_path = str(socket_path)
        self.timeout_s = timeout_s
        self.generation = generation
        self._regions: dict[str, RetainedRegion] = {}
        self.export_ms = 0.0
        """Time the manager spent exporting GPU pages for this client (diagnostics)."""
        self._sock = _connect(self.socket_path, timeout_s)

    def allocate(
        self,
        name: str,
        nbytes: int,
        *,
        page_bytes: int,
        protected: bool,
        device: int | None = None,
        replace: bool = False,
    ) -> RetainedRegion:
        """Allocate region `name` (or reuse it, `fresh` False) and map it; `device` (a CUDA
        ordinal) puts it in GPU memory; `replace` frees and remakes a region that exists with
        another geometry (the rank restarts under another plan) instead of refusing.

        Raises:
            RetainedStateError: the manager refused (bad size, different existing geometry
                without `replace`, no GPU memory).
        """
        fields: dict[str, Any] = {"device": device} if device is not None else {}
        if replace:
            fields["replace"] = True
            old = self._regions.get(name)
            size = -(-nbytes // page_bytes) * page_bytes
            if old is not None and (old.nbytes, old.page_bytes, old.protected, old.device) != (
                size,
                page_bytes,
                protected,
                device,
            ):
                # The manager frees it and makes it anew: unmapped first, so the old memory
                # is gone before the new is created (a premapped region of a whole GPU's size
                # would otherwise be held twice for a moment).
                del self._regions[name]
                old.close()
        info, fds = self._call(
            "allocate",
            name=name,
            nbytes=nbytes,
            page_bytes=page_bytes,
            protected=protected,
            **fields,
        )
        return self._adopt(info, fds)

    def attach(self, name: str) -> RetainedRegion:
        """Map the existing region `name`.

        Raises:
            RetainedStateError: no such region.
        """
        info, fds = self._call("attach", name=name)
        return self._adopt(info, fds)

    def list(self) -> list[dict[str, Any]]:
        """Descriptions ({name, nbytes, page_bytes, protected}) of all regions of the rank."""
        return self._call("list")[0]["regions"]

    def mapped(self) -> dict[str, RetainedRegion]:
        """The regions this client maps now, by name."""
        return dict(self._regions)

    def premap(self) -> list[RetainedRegion]:
        """Map every region the manager holds now, ahead of need (a parked shadow, before its
        promotion: `unbroken.launch.session`). A later `allocate` or `attach` of the same
        region returns the mapping made here if the manager has not re-created the region or
        remapped pages of it since; pages it reports missing by then are unmapped.

        Raises:
            RetainedStateError: the manager refused or a page could not be imported.
        """
        return [self.attach(r["name"]) for r in self.list()]

    def localize(self, names: list[str] | None = None) -> LocalizationReport:
        """Ask the manager which pages are missing (all regions, or `names`)."""
        fields = {} if names is None else {"names": list(names)}
        reply = self._call("localize", **fields)[0]
        return LocalizationReport(lost=reply["lost"], ms=reply["ms"])

    def remap(self, name: str, pages: list[int]) -> float:
        """Give `pages` of `name` healthy memory again (host: zeroed; GPU: new allocations,
        mapped here); returns the manager's ms."""
        pages = sorted({int(p) for p in pages})
        reply, _ = self._call("remap", name=name, pages=pages)
        region = self._regions.get(name)
        if region is not None and region.device is not None:
            region.map_pages(pages, self._import_pages(name, pages))
            region.remaps += 1  # as the manager counts: this mapping has the new pages
        return reply["ms"]

    def discard(self, name: str, pages: list[int]) -> None:
        """GPU regions: the manager drops its allocations of `pages` (page-loss injection)."""
        self._call("discard", name=name, pages=[int(p) for p in pages])

    def free(self, name: str) -> None:
        """Drop region `name` in the manager (this process's mapping stays valid until closed)."""
        self._call("free", name=name)

    def shutdown(self) -> None:
        """Ask the manager to exit (retained memory is released)."""
        self._call("shutdown")

    def close(self) -> None:
        """Close the connection and this process's mappings (retained memory is untouched)."""
        for region in self._regions.values():
            region.close()
        self._regions.clear()
        self._sock.close()

    def __enter__(self) -> RetainedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _adopt(self, info: dict[str, Any], fds: list[int]) -> RetainedRegion:
        gpu = info.get("device") is not None
        if len(fds) != (0 if gpu else 1):
            for fd in fds:
                os.close(fd)
            raise RetainedStateError(
                f"expected {0 if gpu else 1} fd(s) for {info.get('name')!r}, got {len(fds)}"
            )
        old = self._regions.get(info["name"])
        if (
            old is not None
            and old.serial == info.get("serial", 0)
            and old.remaps == info.get("remaps", 0)
            and _same_file(old, fds)
        ):
            for fd in fds:
                os.close(fd)  # map once per region: keep the existing mapping
            old.fresh = info["fresh"]
            if old.device is not None:
                # Mapped before pages were lost (a shadow's premapping): this process's
                # mapping alone keeps their memory; dropped, it is gone as the manager says.
                held = set(old.mapped_pages())
                stale = [p for p in info.get("missing", ()) if p in held]
                if stale:
                    old.unmap_pages(stale)
            return old
        if old is not None:
            old.close()  # the manager freed and re-created it: the old mapping is stale
        handles = None
        if gpu:
            lost = set(info.get("missing", ()))
            n_pages = info["nbytes"] // info["page_bytes"]
            handles = self._import_pages(info["name"], [p for p in range(n_pages) if p not in lost])
        region = RetainedRegion(info, fds, handles)
        self._regions[region.name] = region
        return region

    def _import_pages(self, name: str, pages: list[int]) -> list[Any]:
        """Handles to `pages` of GPU region `name`: exported by the manager a batch at a time,
        each fd imported and closed on arrival (the fds in flight stay within one batch)."""
        from unbroken.state import cuda_vmm

        handles: list[Any] = []
        try:
            for at in range(0, len(pages), FDS_PER_MESSAGE):
                batch = pages[at : at + FDS_PER_MESSAGE]
                reply, fds = self._call("export", name=name, pages=batch)
                self.export_ms += reply.get("ms", 0.0)
                if len(fds) != len(batch):
                    for fd in fds:
                        os.close(fd)
                    raise RetainedStateError(
                        f"export of {name!r}: {len(fds)} fds for {len(batch)} pages"
                    )
                for i, fd in enumerate(fds):
                    try:
                        handles.append(cuda_vmm.import_fd(fd))  # closes fd
                    except cuda_vmm.CudaVmmError as exc:
                        for rest in fds[i + 1 :]:
                            os.close(rest)
                        raise RetainedStateError(f"export of {name!r}: {exc}") from exc
        except BaseException:
            for handle in handles:
                cuda_vmm.release(handle)
            raise
        return handles

    def _call(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        if self.generation is not None:
            fields["generation"] = self.generation
        try:
            send_frame(self._sock, {"op": op, **fields})
            reply, fds = recv_reply(self._sock)
        except (OSError, FrameError) as exc:
            raise RetainedStateError(f"state manager at {self.socket_path}: {op}: {exc}") from exc
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise RetainedStateError(f"state manager refused {op}: {reply.get('error')}")
        return reply, fds


def _same_file(old: RetainedRegion, fds: list[int]) -> bool:
    """Whether `fds` are the region `old` maps (GPU regions: the serial number decides)."""
    if old.device is not None:
        return True
    a, b = os.fstat(old.fd), os.fstat(fds[0])
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _connect(path: str, timeout_s: float) -> socket.socket:
    """Connect, waiting for the manager to create its socket (it appears ready, by rename)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise RetainedStateError(
                    f"no state manager at {path} after {timeout_s:.1f} s: {exc}"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
