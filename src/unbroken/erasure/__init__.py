"""Reed–Solomon erasure coding of retained state (Leto §4.1, §5.2, §7).

Owns the code (GF(2^8), Cauchy generator, systematic, MDS for D + H ≤ 256), its CPU and GPU
kernels, and the two-tier protection group. It never allocates retained memory (the state
manager does), never decides when to encode or repair (the updater and recovery do), and never
writes a page when a loss is beyond repair.

Interface (stable; other packages call only these)::

    geometry = ErasureGeometry(page_bytes=2 << 20, data_pages=240, parity_pages=16,
                               second_tier_pages=1)             # validated at construction
    codec = get_codec(k, m, device="cpu" | "cuda", backend="auto")   # -> Codec
    codec.encode(data: Pages, parity: Pages)                    # parity = Encode(data)
    codec.update(parity, deltas: {page: delta} | PageTable, offset=0)
                                                                # parity[off:] ^= Encode(delta)
    codec.update_from_old_new(parity, old, new, offset=0)       # fused hot path
    codec.reconstruct(pages: [buffer | None] * (k + m) | PageTable, lost)
                                                                # raises UnrecoverableError
    group = ProtectionGroup(geometry, data, first_tier, second_tier, name="g0")
    group.encode(); group.update_chunk(undo, offset=a); group.refresh_second_tier()
    group.reconstruct(lost)        # numbering: data 0..D-1, tier 1 D.., tier 2 D+H1..

Buffers are numpy arrays, torch tensors (CPU or CUDA) or bytearrays/memoryviews, contiguous,
used in place. `PageTable(pages)` resolves a page list to addresses once; `.slice(a, n)` and
`.take(idx)` derive byte ranges and subsets for free — use it on the per-iteration path.

Backends (`get_codec(backend=...)`): ``native`` (C kernel compiled on first use: AVX-512+GFNI,
AVX2 or portable C), ``isal`` (Intel ISA-L from the pyeclib wheel), ``numpy`` (reference),
``triton`` (CUDA tensors). All produce identical bytes.
"""

from unbroken.erasure._buffers import PageTable
from unbroken.erasure.backends import BackendUnavailableError, available_backends, get_codec
from unbroken.erasure.codec import Codec, PageDeltas, Pages
from unbroken.erasure.decoding import ReconstructionPlan, plan_reconstruction
from unbroken.erasure.errors import GeometryError, UnrecoverableError
from unbroken.erasure.geometry import ErasureGeometry
from unbroken.erasure.group import ProtectionGroup

__all__ = [
    "BackendUnavailableError",
    "Codec",
    "ErasureGeometry",
    "GeometryError",
    "PageDeltas",
    "PageTable",
    "Pages",
    "ProtectionGroup",
    "ReconstructionPlan",
    "UnrecoverableError",
    "available_backends",
    "get_codec",
    "plan_reconstruction",
]
