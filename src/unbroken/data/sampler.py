"""The deterministic sampler: micro-batch = f(seed, iteration, logical shard, micro-batch index).

No state, no process history: a redone iteration (after any failure, on any process) gets the
same inputs. Logical shards are the data-parallel replicas of the logical job; micro-batch
migration between replicas (re-planning) only changes who computes a logical micro-batch,
never which tokens it holds.
"""

from __future__ import annotations

from unbroken.data.packing import MicroBatch, PackedStream

__all__ = ["Sampler"]


class Sampler:
    """Maps (iteration, shard, micro-batch) to a packed window of the stream.

    Args:
        stream: the packed corpus.
        n_shards: logical data shards (data-parallel replicas of the logical job).
        microbatches: micro-batches per shard per iteration.
    """

    def __init__(self, stream: PackedStream, n_shards: int, microbatches: int) -> None:
        if n_shards < 1 or microbatches < 1:
            raise ValueError("n_shards and microbatches must be >= 1")
        self.stream = stream
        self.n_shards = n_shards
        self.microbatches = microbatches

    def global_index(self, iteration: int, shard: int, microbatch: int) -> int:
        if not (0 <= shard < self.n_shards and 0 <= microbatch < self.microbatches):
            raise IndexError(f"shard {shard} / micro-batch {microbatch} out of range")
        return (iteration * self.n_shards + shard) * self.microbatches + microbatch

    def get(self, iteration: int, shard: int, microbatch: int) -> MicroBatch:
        return self.stream.window(self.global_index(iteration, shard, microbatch))

    def iteration(self, iteration: int, shard: int) -> list[MicroBatch]:
        return [self.get(iteration, shard, m) for m in range(self.microbatches)]
