"""A workload with phases, for `unbroken bench detect --workload phases`.

The default bench draws documents independently every iteration, so its iteration time swings
around one level: noise to a change-point detector. Real pre-training data also changes level
for a while — a data-mixture phase of short documents (chat, Q&A), a sequence-length curriculum
— and such a run of cheaper or dearer iterations is exactly what a change-point detector without
a workload model mistakes for a fail-slow (ResiHP §2.2). `PhasedSource` makes those runs out of
the same corpus: the job's iterations fall into phases of `phase_iters`; a phase is *short*
with probability 1/2 (drawn from the job's seed and the phase index, so a redone iteration gets
the same inputs), and in a short phase every document of a micro-batch is cut into segments of
at most `short_tokens` tokens, attended to separately. The tokens are the same; only the
attention structure changes, so the micro-batch costs αN + βΣl² with a much smaller Σl².
"""

from __future__ import annotations

import numpy as np

from unbroken.data.packing import IGNORE_INDEX, MicroBatch, segment_layout

__all__ = ["PhasedSource", "split_documents"]


def split_documents(mb: MicroBatch, max_tokens: int) -> MicroBatch:
    """`mb` with every document cut into consecutive segments of at most `max_tokens` tokens
    (positions restart and no target crosses a segment boundary, as between documents)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    lengths: list[int] = []
    for n in mb.doc_lengths:
        full, rest = divmod(int(n), max_tokens)
        lengths += [max_tokens] * full + ([rest] if rest else [])
    seg, positions = segment_layout(lengths)
    targets = mb.targets.clone()
    targets[:-1][seg[1:] != seg[:-1]] = IGNORE_INDEX
    return MicroBatch(
        tokens=mb.tokens,
        targets=targets,
        segment_ids=seg,
        positions=positions,
        doc_lengths=tuple(lengths),
        index=mb.index,
    )


class PhasedSource:
    """Wraps a batch source (`iteration(iteration, shard)`); see the module docstring.

    Args:
        source: the job's sampler.
        seed: the job's seed (which phases are short).
        phase_iters: iterations per phase.
        short_tokens: longest segment in a short phase.
    """

    def __init__(self, source, seed: int, phase_iters: int = 6, short_tokens: int = 128) -> None:
        if phase_iters < 1 or short_tokens < 1:
            raise ValueError("phase_iters and short_tokens must be >= 1")
        self.source = source
        self.seed = seed
        self.phase_iters = phase_iters
        self.short_tokens = short_tokens

    def short(self, iteration: int) -> bool:
        """Whether `iteration` falls in a short-document phase."""
        phase = iteration // self.phase_iters
        return bool(np.random.default_rng([self.seed, phase]).random() < 0.5)

    def iteration(self, iteration: int, shard: int) -> list[MicroBatch]:
        batches = self.source.iteration(iteration, shard)
        if not self.short(iteration):
            return batches
        return [split_documents(mb, self.short_tokens) for mb in batches]
