"""The GPU chunk transaction with its AdamW step and parity staging fused into one kernel
(issue 16, item 2: the resumable updater at GPU speed).

The ten-launch transaction (`GraphUpdater` with ``fused=False``, as `ResumableUpdater`
writes it) moves a chunk's bytes five times: the undo copy reads and writes it, the AdamW step
reads and writes it, the first tier's update reads the undo copy and the new data again, and
the staging copy and two write-backs move the parity range. The tier-1 update is also the
slowest kernel of the transaction: 96 columns of GF(2^8) arithmetic per word. Here the step
itself forms old ^ new of every word it writes and folds it into the parity range in
registers (`_triton_transaction.chunk_transaction_kernel`), so the data is read once by the
undo copy and once by the fused kernel, and written once by each; the write-back is one copy.
A transaction is six launches:

    undo copy | marker CHUNK_UPDATING | step + scratch = committed parity ^ delta (both tiers)
    | marker PARITY_READY | write-back (scratch -> parity, both tiers) | marker SYNCED / IDLE

Crash semantics (the same stages and fix-ups as `ResumableUpdater`; every marker write is
made by the stream, after the work before it, see `unbroken.update.device_marker`):

- killed before CHUNK_UPDATING lands: the chunk's data and parity are the committed ones
  (the fused kernel has not started: stream order); nothing to repair, the update resumes at
  this chunk.
- killed while the fused kernel runs (the marker says CHUNK_UPDATING): the chunk's data may be
  any mix of old and new words, scratch any mix of stale and new parity; the committed parity
  is untouched (the kernel only reads it). `repair` restores the chunk from the undo buffer,
  complete before the marker was written, and data and parity agree again.
- killed after PARITY_READY lands: the data is new and scratch holds its parity, both
  complete; the write-back may be partial. `repair` writes scratch back (idempotent) and
  commits.

So chunk granularity is kept for recovery, and a resumed update (`StreamUpdater`'s
unfused transactions) computes the same bits: the fused kernel steps with the same AdamW body
(`_triton_adamw.adamw_math`) and its parity is exact GF(2^8) arithmetic, equal to the codec's.
The CPU never takes this path.

Measured on an H200 at 1b (57 whole-page chunks; bench/results/gpu-h200.md, stop 36): 22.1 ms
a protected update against 25.1 ms for the ten-launch graph and 6.7 ms for the plain update.
Of it, 15.4 ms is the fused kernel, bound by the GF(2^8) arithmetic (its 448 MiB a chunk
would take about 7 ms at the plain update's bandwidth), and 6.0 ms the undo copies.
With the Vandermonde first tier (stop 40: Horner's rule, `_triton_horner`) the kernel takes
7.5 ms, near that bandwidth, and the update 13.9 ms = 2.1x plain (Cauchy: 21.0 ms).
"""

from __future__ import annotations

import numpy as np
import torch

from unbroken.erasure import gf256
from unbroken.erasure._word_tables import plane_table, word_table
from unbroken.update.host_pin import DevicePointer

__all__ = ["DEFAULT_FUSED_TUNING", "FusedTransaction", "fused_capable"]

DEFAULT_FUSED_TUNING = {"planes": 0, "block": 512, "warps": 4}
"""planes: the parity arithmetic's form: 0 the word table's, 1 the bit-plane form with eight
accumulators, 2 the bit-plane form with one plane-major accumulator (one vector load of a
column's masks); block: words per program; warps: per program. The bit-plane forms apply only
to first tiers of at most 4 pages (8 accumulators per row); larger ones take form 0. Chosen on
an H200 among 13 settings (bench/results/gpu-h200.md, stop 36): the word table over 512 words
and 4 warps took 15.3 ms for the 57 chunks of 1b, the best bit-plane setting 15.7 ms."""


def _pow2(n: int) -> int:
    value = 1
    while value < n:
        value *= 2
    return value


def _addressable(t: torch.Tensor):
    """`t` as a Triton pointer argument, a registered host tensor by its address."""
    return t if t.is_cuda else DevicePointer(t.data_ptr(), t.dtype)


def _segment_factors(d: int) -> np.ndarray:
    """The Horner kernel's segment factors ``(2^r)^(s·d)`` for r, s in 1..2, as `word_table`
    columns: int32 [4, 8] in the order (r=1, s=1), (r=1, s=2), (r=2, s=1), (r=2, s=2)."""
    exponents = np.array([r * s * d % 255 for r in (1, 2) for s in (1, 2)])
    factors = gf256.exp_table()[exponents][None, :]  # one row, four columns
    return np.ascontiguousarray(word_table(factors, 1).reshape(4, 8))


def fused_capable(h1: int, h2: int) -> bool:
    """Whether the fused kernel covers tiers of h1 and h2 pages (one program holds a
    power-of-two block of rows of each)."""
    return 1 <= h1 <= 16 and 0 <= h2 <= 16


class FusedTransaction:
    """Launches the fused step of one chunk (see the module docstring).

    Args:
        geometry: the state's pages, stripes and chunks.
        segments: the flat fp32 parameters, gradients, exp_avg and exp_avg_sq.
        parity: the model groups' parity, uint8 [groups, H1 + H2, page_bytes], on the device
            or in host memory registered with CUDA (the kernel reads it in place).
        scratch: the staging slots, uint8 [slots, H1 + H2, chunk_bytes].
        h1, h2: the tiers' page counts.
        codecs: (first tier, second tier or None) codec of each group, to check that they
            encode with the matrices this kernel computes.
        generator: the first tier's generator (`gf256.GENERATORS`): ``cauchy`` takes the table
            kernel, ``vandermonde`` (H1 <= 3) Horner's rule (`_triton_horner`). The second
            tier is Cauchy.
        tuning: overrides of `DEFAULT_FUSED_TUNING` (the bench sweeps them).

    Raises:
        ValueError: tiers the kernel does not cover, or codecs with other matrices.
    """

    def __init__(
        self,
        geometry,
        segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        parity: torch.Tensor,
        scratch: torch.Tensor,
        h1: int,
        h2: int,
        *,
        codecs=(),
        tuning: dict[str, int] | None = None,
        generator: str = "cauchy",
    ) -> None:
        if not fused_capable(h1, h2):
            raise ValueError(f"the fused transaction covers tiers of <= 16 pages, not {h1}/{h2}")
        self.horner = generator == "vandermonde"
        d = geometry.stripe_pages
        t = {**DEFAULT_FUSED_TUNING, **(tuning or {})}
        self.r1, self.r2 = _pow2(h1), _pow2(max(h2, 1))
        self.planes = t["planes"] if self.r1 <= 4 else 0
        self.block, self.warps = t["block"], t["warps"]
        m1 = gf256.generator_matrix(3 * d, h1, generator)
        m2 = gf256.cauchy_matrix(h1, h2) if h2 else np.zeros((1, h1), dtype=np.uint8)
        for first, second in codecs:
            if not np.array_equal(first.matrix, m1) or (
                h2 and not np.array_equal(second.matrix, m2)
            ):
                raise ValueError(f"{first.name}: codec matrices differ from the fused tables")
        dev = segments[0].device
        if self.horner:
            t1 = _segment_factors(d)
        elif self.planes:
            t1 = plane_table(m1, self.r1)
        else:
            t1 = word_table(m1, self.r1)
        self._t1 = torch.from_numpy(np.ascontiguousarray(t1)).to(dev)
        self._t2 = torch.from_numpy(np.ascontiguousarray(word_table(m2, self.r2))).to(dev)
        self.h1, self.h2, self.d = h1, h2, d
        self.geometry = geometry
        self.segments = segments
        # int32 words of each group's committed parity and of each scratch slot.
        self._parity = [p.view(torch.int32) for p in parity]
        self._scratch = [sl.view(torch.int32) for sl in scratch]

    @classmethod
    def of(cls, updater, tuning: dict[str, int] | None = None) -> FusedTransaction:
        """The fused transaction over a `StreamUpdater`'s state, parity and scratch."""
        s = updater.state
        return cls(
            updater.geometry,
            (s.params, s.grads, s.exp_avg, s.exp_avg_sq),
            updater.model_parity,
            updater.scratch,
            updater.h1,
            updater.h2,
            codecs=[(g.first_tier_codec, g.second_tier_codec) for g in updater.groups],
            tuning=tuning,
            generator=updater.layout.generator,
        )

    def launch(
        self,
        ref,
        coeffs: torch.Tensor,
        *,
        first_index: int,
        decay_end: int,
        slot: int = 0,
        committed: torch.Tensor | None = None,
    ) -> None:
        """Step chunk `ref` in place and stage its parity range into scratch slot `slot` (one
        launch on the current stream; `coeffs`: the fp32 [8] device block of
        `fused_adamw_dev_`). `committed`: the chunk's committed parity range, uint8 [H1 + H2,
        chunk_bytes], where it was staged (`unbroken.update.host_parity`); default: read in
        place in the parity."""
        from unbroken.update._triton_horner import chunk_transaction_horner_kernel
        from unbroken.update._triton_transaction import chunk_transaction_kernel

        g = self.geometry
        p, gr, m, v = (g.chunk_view(x, ref) for x in self.segments)
        lo, hi = ref.byte_lo // 4, ref.byte_hi // 4
        if committed is None:
            par = self._parity[ref.group][:, lo:hi]
        else:
            par = committed.view(torch.int32)
        scr = self._scratch[slot]
        cols = hi - lo
        grid = (-(-cols // self.block),)
        if self.horner:
            chunk_transaction_horner_kernel[grid](
                p, gr, m, v, cols, p.stride(0), first_index, decay_end, coeffs,
                _addressable(par), par.stride(0), scr, scr.stride(0), self._t1, self._t2, self.d,
                H1=self.h1, R1=self.r1, H2=self.h2, R2=self.r2,
                BLOCK=self.block, num_warps=self.warps,
            )  # fmt: skip
            return
        chunk_transaction_kernel[grid](
            p, gr, m, v, cols, p.stride(0), first_index, decay_end, coeffs,
            _addressable(par), par.stride(0), scr, scr.stride(0), self._t1, self._t2, self.d,
            H1=self.h1, R1=self.r1, H2=self.h2, R2=self.r2,
            BLOCK=self.block, PLANES=self.planes, num_warps=self.warps,
        )  # fmt: skip
