"""The graph updater's traffic to the model's parity in host memory (Leto §5.2, "Minimizing
memory and transfer overhead"): each transaction's committed parity range is copied into HBM
ahead of its kernel, and its new parity copied back behind it, on two copy streams beside the
compute stream, so PCIe time hides under the fused kernels.

Per transaction k (whole-page chunks of 1b: 10 MiB each way over PCIe, against about 0.4 ms of
kernels):

    ahead stream:   [kernel k-2 has read stage k%2] H2D committed range -> stage[k % 2]
    compute stream: undo copy | CHUNK_UPDATING | [H2D k done] fused kernel(stage -> scratch
                    slot k%2) | PARITY_READY | commit marker
    behind stream:  [PARITY_READY k] D2H scratch slot k%2 -> host range

Transaction k's undo copy also waits for write-back k - 2 (its scratch slot is reused), and the
IDLE after the last transaction for every write-back. The staging buffers are a cache of host
parity that nothing after a crash reads; the scratch slots and the host parity keep the
invariants of [Note: write-back behind the marker] (`unbroken.update.rmu`), so `repair` is
unchanged. Measured on an H200 at 1b (bench/results/gpu-h200.md, stop 38): 22.7 ms an update
staged, against 21.9 ms with the parity in HBM and 30.4 ms with the kernel reading the host
range in place (its PCIe reads stalled the kernel; the copy engines' 13.8 ms H2D and 11.9 ms
D2H per update overlap with it).

Hand-written: torch has no pipelined host <-> device staging for a captured graph; the pieces
are torch streams, events and copies.

Everything here runs inside the graph capture: a side stream joins the capture by waiting on an
event recorded on the capturing stream, and rejoins it by the compute stream waiting on its
last event.
"""

from __future__ import annotations

import torch

from unbroken.update.rmu import copy_rows

__all__ = ["HostParityStreams"]


class HostParityStreams:
    """Staging and write-back of host-memory parity for one graph capture.

    Args:
        parity: the model groups' parity in host memory registered with CUDA, [groups, w, S].
        scratch: the updater's scratch slots, [2, w, c] on the device.
        chunk_bytes: c.
        device: the CUDA device.
    """

    def __init__(
        self, parity: torch.Tensor, scratch: torch.Tensor, chunk_bytes: int, device
    ) -> None:
        self.parity = parity
        self.scratch = scratch
        self.chunk_bytes = chunk_bytes
        self.device = device
        self.stage = torch.empty_like(scratch)
        """Two HBM slots of committed parity ranges, transaction k's in slot k % 2."""
        self._ahead = torch.cuda.Stream(device)
        self._behind = torch.cuda.Stream(device)
        self._start: torch.cuda.Event | None = None
        self._read: dict[int, torch.cuda.Event] = {}
        self._written: dict[int, torch.cuda.Event] = {}

    def _main(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def begin(self) -> None:
        """At the start of a capture, on the capturing stream."""
        self._start = self._record(self._main())
        self._read, self._written = {}, {}

    def before_undo(self, k: int) -> None:
        """Transaction k's scratch slot is free once write-back k - 2 has landed."""
        if k - 2 in self._written:
            self._main().wait_event(self._written.pop(k - 2))

    def committed(self, ref, k: int) -> torch.Tensor:
        """Transaction k's committed parity range in HBM, [w, c]: copied ahead (once the
        kernel of k - 2 has read the slot); the compute stream waits for the copy."""
        assert self._start is not None, "begin() first"
        slot = self.stage[k % 2]
        free = self._read.pop(k - 2, self._start)
        x, c = ref.byte_lo, self.chunk_bytes
        with torch.cuda.stream(self._ahead):
            self._ahead.wait_event(free)
            copy_rows(slot, self.parity[ref.group][:, x : x + c])
            copied = self._record(self._ahead)
        self._main().wait_event(copied)
        return slot

    def after_kernel(self, k: int) -> None:
        """Transaction k's kernel has read its staging slot (record on the compute stream)."""
        self._read[k] = self._record(self._main())

    def write_back(self, ref, slot: int, k: int) -> None:
        """Scratch slot `slot` into transaction k's host range, behind PARITY_READY."""
        ready = self._record(self._main())
        x, c = ref.byte_lo, self.chunk_bytes
        with torch.cuda.stream(self._behind):
            self._behind.wait_event(ready)
            copy_rows(self.parity[ref.group][:, x : x + c], self.scratch[slot])
            self._written[k] = self._record(self._behind)

    def join(self) -> None:
        """Before the IDLE marker: every write-back has landed, and both side streams are back
        in the capture."""
        main = self._main()
        for k in sorted(self._written):
            main.wait_event(self._written.pop(k))
        self._read.clear()  # the ahead stream's copies all preceded these kernels
        self._start = None
