"""Reconstruction plans: which surviving pages to read and the matrix that rebuilds the lost ones.

A plan is pure math over the generator (no page is touched), so it is computed once per erasure
pattern and cached. It rebuilds every lost page — data and parity — in one pass over k
survivors: a lost data page is solved from e surviving parity rows (an e × e inversion of a
Cauchy submatrix, e = number of lost data pages), and a lost parity page is its generator row
with the lost data substituted. Reading the data once is what makes a 16-page reconstruction of
a 480 MiB group cost one pass over it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from unbroken.erasure import gf256
from unbroken.erasure.errors import UnrecoverableError

__all__ = ["ReconstructionPlan", "plan_reconstruction"]


@dataclass(frozen=True, slots=True)
class ReconstructionPlan:
    """How to rebuild lost pages of a (k, m) code: ``page[targets[i]] = XOR_j
    matrix[i, j]·page[sources[j]]``."""

    sources: tuple[int, ...]
    """The k surviving pages read (data pages first, then parity pages)."""
    targets: tuple[int, ...]
    """The lost pages written, in ascending order."""
    matrix: np.ndarray
    """len(targets) × k coefficients (read-only uint8)."""


def plan_reconstruction(
    data_pages: int,
    parity_pages: int,
    lost: Iterable[int],
    *,
    group: str = "code",
    generator: str = "cauchy",
) -> ReconstructionPlan:
    """Plan the reconstruction of ``lost`` pages of a (k, m) code with the named generator
    (`gf256.generator_matrix`).

    Pages are numbered 0..k-1 (data) and k..k+m-1 (parity).

    Args:
        data_pages: k.
        parity_pages: m.
        lost: indices of the lost pages.
        group: name used in the error message.

    Returns:
        The plan; its ``targets`` are the sorted lost pages.

    Raises:
        UnrecoverableError: if more than m pages are lost.
        ValueError: if an index is out of range.
    """
    lost_pages = tuple(sorted(set(lost)))
    total = data_pages + parity_pages
    for page in lost_pages:
        if not 0 <= page < total:
            raise ValueError(f"page index {page} out of range for a code of {total} pages")
    if len(lost_pages) > parity_pages:
        raise UnrecoverableError(
            group=group,
            lost=lost_pages,
            detail=f"{len(lost_pages)} lost pages exceed the tolerance of {parity_pages}",
        )
    return _plan(data_pages, parity_pages, lost_pages, generator)


@functools.lru_cache(maxsize=512)
def _plan(k: int, m: int, lost: tuple[int, ...], kind: str) -> ReconstructionPlan:
    generator = gf256.generator_matrix(k, m, kind)
    lost_set = set(lost)
    lost_data = [j for j in lost if j < k]
    lost_parity = [p - k for p in lost if p >= k]
    kept_data = [j for j in range(k) if j not in lost_set]
    spare_rows = [r for r in range(m) if k + r not in lost_set][: len(lost_data)]
    sources = tuple(kept_data) + tuple(k + r for r in spare_rows)

    e = len(lost_data)
    # d_lost = inv · (p_spare ⊕ C[spare, kept] · d_kept), so over the sources (kept, spare):
    # d_lost = [inv · C[spare, kept] | inv].
    if e:
        inv = gf256.invert_matrix(generator[np.ix_(spare_rows, lost_data)])
        data_rows = np.concatenate(
            [gf256.matmul(inv, generator[np.ix_(spare_rows, kept_data)]), inv], axis=1
        )
    else:
        data_rows = np.zeros((0, k), dtype=np.uint8)
    # p_r = C[r, kept] · d_kept ⊕ C[r, lost] · d_lost, with d_lost expressed over the sources.
    parity_rows = np.zeros((len(lost_parity), k), dtype=np.uint8)
    if lost_parity:
        direct = np.zeros((len(lost_parity), k), dtype=np.uint8)
        direct[:, : len(kept_data)] = generator[np.ix_(lost_parity, kept_data)]
        parity_rows = direct
        if e:
            parity_rows = direct ^ gf256.matmul(
                generator[np.ix_(lost_parity, lost_data)], data_rows
            )
    matrix = np.concatenate([data_rows, parity_rows], axis=0)
    matrix.setflags(write=False)
    return ReconstructionPlan(sources=sources, targets=lost, matrix=matrix)
