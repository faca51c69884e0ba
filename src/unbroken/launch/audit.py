"""The bit-exact audit's view of one rank set: every rank hashes its own state (replicas
included), the hashes are gathered, and what the job records is all of them — the job's hash,
each rank's hash, and any replica that differs from its peers.

A data-parallel replica whose state silently differs from its peers' (a wrong repair on a
non-zero rank, a flipped bit) changes no other rank's hash; only hashing every rank catches it
at the iteration it happens, not through later all-reduces — or never, when it happens in the
last iterations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Audit", "gather_hashes", "replica_mismatches"]


def gather_hashes(own: str, group) -> list[str]:
    """Every rank's hash, in rank order (collective over `group`; one process without one)."""
    if group is None:
        return [own]
    hashes: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, own, group=group)
    return [str(h) for h in hashes]


def replica_mismatches(hashes: list[str], replica_sets) -> list[int]:
    """Ranks whose hash differs from the one most of their replica set holds (ties: the
    lowest rank's hash is taken as the replica state)."""
    out = []
    for ranks in replica_sets:
        counts = Counter(hashes[r] for r in ranks)
        top = max(counts.values())
        agreed = next(hashes[r] for r in sorted(ranks) if counts[hashes[r]] == top)
        out += [r for r in ranks if hashes[r] != agreed]
    return sorted(out)


@dataclass(frozen=True, slots=True)
class Audit:
    """One hashed iteration's record (rank 0 writes it)."""

    job_hash: str
    rank_hashes: list[str]
    mismatched: list[int]
    """Ranks whose replica differs from its peers."""
