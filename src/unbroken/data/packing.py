"""Packing documents into micro-batches of exactly N tokens, keeping document boundaries.

Epoch e orders the documents by a permutation drawn from (seed, e); the concatenated stream is
cut into consecutive windows of N tokens. A document that crosses a window boundary continues in
the next window as a new segment. Each micro-batch keeps its segment lengths l_i, which the
fail-slow detector's workload model (T_MB = alpha*N + beta*sum(l_i^2)) needs, and attention is
restricted to within segments (block-diagonal causal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from unbroken.data.corpus import Corpus

__all__ = ["IGNORE_INDEX", "MicroBatch", "PackedStream", "segment_layout"]

IGNORE_INDEX = -100
"""Target value of positions that predict nothing (the last token of each segment)."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One packed micro-batch of N tokens.

    Attributes:
        tokens: int64 [N] input token ids.
        targets: int64 [N] next-token targets; IGNORE_INDEX where the next token is in another
            segment.
        segment_ids: int32 [N] segment of each position (0, 1, ...), for block-diagonal masks.
        positions: int64 [N] position within the segment (RoPE restarts per document).
        doc_lengths: the segment lengths l_i, summing to N.
        index: (epoch, window) this micro-batch was cut from, for logs and tests.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    segment_ids: torch.Tensor
    positions: torch.Tensor
    doc_lengths: tuple[int, ...]
    index: tuple[int, int]

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def n_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def segment_layout(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id (int32) and position within its segment (int64) of every token of
    consecutive segments of these lengths."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)
    seg_start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return seg, torch.arange(int(lens.sum()), dtype=torch.int64) - seg_start


class PackedStream:
    """Cuts a corpus into N-token windows, epoch by epoch, deterministically from a seed."""

    def __init__(self, corpus: Corpus, tokens_per_microbatch: int, seed: int) -> None:
        self.corpus = corpus
        self.n = tokens_per_microbatch
        self.seed = seed
        self.windows_per_epoch = int(corpus.offsets[-1]) // self.n
        if self.windows_per_epoch < 1:
            raise ValueError(
                f"corpus {corpus.name} has {int(corpus.offsets[-1])} tokens, fewer than one "
                f"micro-batch of {self.n}"
            )
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._epoch_cache.get(epoch)
        if cached is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.corpus.n_docs)
            lengths = self.corpus.doc_lengths()[perm]
            starts = np.zeros(len(perm) + 1, dtype=np.int64)
            np.cumsum(lengths, out=starts[1:])
            cached = (perm, starts)
            if len(self._epoch_cache) > 4:
                self._epoch_cache.clear()
            self._epoch_cache[epoch] = cached
        return cached

    def window(self, global_index: int) -> MicroBatch:
        """The micro-batch cut at global window index `global_index` (epochs concatenated)."""
        epoch, k = divmod(global_index, self.windows_per_epoch)
        perm, starts = self._epoch(epoch)
        lo, hi = k * self.n, (k + 1) * self.n
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        pieces, lengths = [], []
        d = first
        while starts[d] < hi:
            a, b = max(lo, int(starts[d])), min(hi, int(starts[d + 1]))
            src = int(self.corpus.offsets[perm[d]])
            pieces.append(self.corpus.tokens[src + a - int(starts[d]) : src + b - int(starts[d])])
            lengths.append(b - a)
            d += 1
        toks = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        seg, pos = segment_layout(lengths)
        targets = torch.full((self.n,), IGNORE_INDEX, dtype=torch.int64)
        same = seg[1:] == seg[:-1]
        targets[:-1][same] = toks[1:][same]
        return MicroBatch(
            tokens=toks,
            targets=targets,
            segment_ids=seg,
            positions=pos,
            doc_lengths=tuple(lengths),
            index=(epoch, k),
        )
