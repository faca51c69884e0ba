"""A fingerprint of a tensor's bytes computed where the tensor lives (for the GPU audit).

`TrainState.state_hash` is sha256 over the state's bytes. On a GPU that means copying the
whole state to the host and hashing it on one CPU core every hashed iteration: 1.5 GB at 125m
took ~1.5 s per iteration on the H200 machine (2.4 s iterations against ~0.1 s of training),
and 11 GB at 1b would take ~15 s. Here the device reduces the bytes to a few numbers per slice
and only those cross to the host, where sha256 finishes the hash.

Per slice of 2^24 16-bit words (32 MiB), two independent polynomial fingerprints modulo the
prime p = 2^31 - 1: sum_i x_i * w_i mod p with weights w_i = ((i mod p) * A + B) mod p from the
word's global index i, for two fixed (A, B). A 16-bit word is below p, so a change of one word
always changes both sums; any other change goes unnoticed by both with probability about
p^-2 = 2^-62 (for differences that are not chosen against the weights — the audit compares a
run with its own reference, not with an adversary). Every intermediate stays below 2^63
(products below 2^47 are reduced before summing 2^24 of them), so the arithmetic is exact
integer arithmetic and the result is the same on any device and in any reduction order.

Hand-written because no library computes a keyed digest of device memory in place; torch
operations only, no kernel of our own.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["SLICE_WORDS", "device_digest", "slot_digests"]

P = (1 << 31) - 1
WEIGHTS = ((0x5BD1E995 % P, 0x27D4EB2F % P), (0x165667B1 % P, 0x61C88647 % P))
SLICE_WORDS = 1 << 24


def device_digest(t: torch.Tensor, *, slice_words: int = SLICE_WORDS) -> bytes:
    """sha256 (32 bytes) over the per-slice fingerprints of `t`'s bytes (see the module
    docstring), computed on `t`'s device. `t`'s byte count must be even."""
    words = t.detach().contiguous().view(torch.uint8).reshape(-1).view(torch.int16)
    h = hashlib.sha256(str(words.numel()).encode())
    sums = []
    for lo in range(0, words.numel(), slice_words):
        x = words[lo : lo + slice_words].to(torch.int64) & 0xFFFF
        idx = torch.arange(lo, lo + x.numel(), device=x.device, dtype=torch.int64) % P
        for a, b in WEIGHTS:
            w = (idx * a + b) % P
            sums.append(((x * w) % P).sum() % P)
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.digest()


def slot_digests(state, tag: str = "", emulate: int = 1, shard_of=None) -> dict[str, str]:
    """Per parameter this state owns (`FlatLayout.slots`: copies of another rank's parameters
    left out), a hash of its values and both AdamW moments, keyed by its name plus `tag` (a
    TP shard's position). The same parameter holds the same bits wherever a plan puts it, so
    these hashes, gathered over the ranks, fingerprint the model state independently of the
    pipeline layout that holds it (`PlanExecutor.job_hash`). A TP-1 stage that computes as a
    TP group of `emulate` (`unbroken.engine.emulate`) hashes each position's shard under that
    position's tag, as the group's ranks would: the same state hashes alike under both
    (`shard_of`: the engine's `(full, name, tp_size, tp_rank) -> shard`)."""
    if emulate > 1 and shard_of is None:
        raise ValueError("hashing per emulated TP position needs the engine's shard_of")
    out = {}
    tensors = list(state.persistent().values())
    for s in state.layout.slots:
        whole = [t[s.offset : s.offset + s.numel] for t in tensors]
        if emulate == 1:
            out[s.name + tag] = _digest(whole)
            continue
        for i in range(emulate):
            pieces = [shard_of(p.view(s.shape), s.name, emulate, i) for p in whole]
            out[f"{s.name}@tp{i}/{emulate}"] = _digest(pieces)
    return out


def _digest(pieces) -> str:
    h = hashlib.sha256()
    for piece in pieces:
        piece = piece.detach().contiguous()
        if piece.is_cuda:
            h.update(device_digest(piece.reshape(-1)))
        else:
            h.update(piece.view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]
