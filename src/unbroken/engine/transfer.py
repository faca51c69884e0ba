"""Point-to-point batches of an action list, with heterogeneous-TP chunking (ResiHP §7, Fig. 7).

Owns the execution of one *batch* — a maximal run of SEND/RECV actions between two compute
actions ([Note: communication placement] in `unbroken.parallel.schedules`): every send and
receive of the batch is posted together with `batch_isend_irecv` on the explicit world group and
waited for before the next compute action, which is what keeps blocking sends from deadlocking.

[Note: chunked messages] A message (an activation, or an input gradient) is the flattened
[T, dim] tensor, replicated on every rank of the sending TP group of degree a. For a receiving
group of degree b it is cut into N = max(a, b) equal contiguous chunks; the plan says which
chunk each SEND/RECV carries and to/from whom (`unbroken.parallel.p2p_chunks`), so each chunk
crosses between the groups exactly once. Receiver position j gets chunks [j·N/b, (j+1)·N/b),
one contiguous 1/b of the message; after the batch the receiving group all-gathers those
slices in TP order, in the order the messages appear in the batch (the same on every rank of
the group, because all of them hold the same receives). a = b = 1 is a plain send.

Tags identify a chunk (direction, sending stage, micro-batch, chunk) so gloo matches messages by
identity; NCCL ignores tags and matches in posting order, which the plan keeps consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.engine.tp import TPGroup
from unbroken.parallel import Action, ActionKind

__all__ = ["MessageKey", "run_batch"]

MessageKey = tuple[ActionKind, int, int]
"""(RECV_F or RECV_B, receiving virtual stage, micro-batch) of a received message."""

_MAX_CHUNKS = 64


def _tag(a: Action, num_stages: int, num_microbatches: int) -> int:
    """The same number on both ends of one chunk's transfer."""
    forward = a.kind in (ActionKind.SEND_F, ActionKind.RECV_F)
    # [Note: send/recv stage indices]: a receive names its own stage, a send the sender's.
    receiver_offset = -1 if forward else 1
    sender_stage = a.stage if a.is_send else a.stage + receiver_offset
    key = (int(forward) * num_stages + sender_stage) * num_microbatches + a.microbatch
    return key * _MAX_CHUNKS + a.chunk


def _chunk(flat: torch.Tensor, chunk: int, num_chunks: int) -> torch.Tensor:
    n = flat.numel()
    if n % num_chunks:
        raise ValueError(f"a message of {n} elements cannot be cut into {num_chunks} chunks")
    per = n // num_chunks
    return flat[chunk * per : (chunk + 1) * per]


@dataclass(slots=True)
class _Incoming:
    chunks: dict[int, torch.Tensor]
    num_chunks: int


# Long: an 18-line docstring and a 12-line signature; the body is 31 lines.
def run_batch(
    batch: Sequence[Action],
    *,
    world: dist.ProcessGroup,
    tp: TPGroup,
    payload: Callable[[Action], torch.Tensor],
    numel: Callable[[int], int],
    num_stages: int,
    num_microbatches: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[MessageKey, torch.Tensor]:
    """Post one batch of SEND/RECV actions together, wait, and assemble what arrived.

    Args:
        batch: the consecutive SEND/RECV actions.
        world: the group the plan's ranks are numbered in.
        tp: this rank's TP group (receivers all-gather over it).
        payload: the whole flat message a SEND action sends a chunk of.
        numel: elements of a message for a micro-batch.
        num_stages, num_microbatches: the plan's, for unique tags.
        dtype, device: of received messages.

    Returns:
        Every message received in the batch, whole and flat, keyed by (kind, stage, mb).

    Raises:
        ValueError: a message that does not split into its chunks, or a received message
            whose chunks are not this rank's contiguous 1/b of it.
    """
    ops: list[dist.P2POp] = []
    incoming: dict[MessageKey, _Incoming] = {}
    for a in batch:
        tag = _tag(a, num_stages, num_microbatches)
        if a.is_send:
            piece = _chunk(payload(a), a.chunk, a.num_chunks)
            ops.append(dist.P2POp(dist.isend, piece, group=world, group_peer=a.peer, tag=tag))
        else:
            total = numel(a.microbatch)
            buf = torch.empty(total // a.num_chunks, dtype=dtype, device=device)
            key = (a.kind, a.stage, a.microbatch)
            incoming.setdefault(key, _Incoming({}, a.num_chunks)).chunks[a.chunk] = buf
            ops.append(dist.P2POp(dist.irecv, buf, group=world, group_peer=a.peer, tag=tag))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    out = {}
    for key, msg in incoming.items():
        per_rank = msg.num_chunks // tp.size
        want = list(range(tp.rank * per_rank, (tp.rank + 1) * per_rank))
        if sorted(msg.chunks) != want:
            raise ValueError(
                f"{key}: TP position {tp.rank} of {tp.size} received chunks "
                f"{sorted(msg.chunks)} of {msg.num_chunks}, expected {want}"
            )
        mine = torch.cat([msg.chunks[c] for c in want]) if per_rank > 1 else msg.chunks[want[0]]
        if tp.size > 1:
            parts = [torch.empty_like(mine) for _ in range(tp.size)]
            dist.all_gather(parts, mine, group=tp.group)
            mine = torch.cat(parts)
        out[key] = mine
    return out
