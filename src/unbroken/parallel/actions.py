"""One step of one rank's iteration: the `Action` of the plan IR and its compact text form.

Owns the vocabulary every consumer of a plan shares (the worker interpreter, the simulator, the
detector, the planner): what kinds of step exist, what fields identify a step, and the text form
used in JSON, CSV and log lines. The text form follows `torch.distributed.pipelining`'s `_Action`
(``"0F3"``, ``"1SEND_F2"``) and adds what that form lacks for heterogeneous hybrid parallelism:
the peer rank of every send/receive and the chunk of a message that is split across a TP group.

[Note: send/recv stage indices] A ``SEND_F`` carries the *sender's* virtual stage and a
``RECV_F`` the *receiver's*, as in torch's pipelining: ``1SEND_F2->r5`` (stage 1 sends the
forward output of micro-batch 2 to rank 5) pairs with ``2RECV_F2<-r4`` on rank 5. A ``SEND_B``
from stage k pairs with a ``RECV_B`` on stage k - 1. The matching rule lives in
`unbroken.parallel.check.transfer_key`.

This module never imports torch and never touches a process group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "Action", "ActionKind", "parse_action"]


class ActionKind(StrEnum):
    """What one action does. The string value is the token used in the text form."""

    F = "F"
    """Forward of one micro-batch through one virtual stage."""
    B = "B"
    """Backward. Full backward, or only the input gradient when the same rank also holds a `W`
    for the same (stage, micro-batch) (zero-bubble schedules split the backward)."""
    W = "W"
    """Weight-gradient half of a split backward; may be deferred to fill bubbles."""
    SEND_F = "SEND_F"
    """Send a forward activation (or one chunk of it) to the next virtual stage."""
    RECV_F = "RECV_F"
    """Receive a forward activation (or one chunk) from the previous virtual stage."""
    SEND_B = "SEND_B"
    """Send an input gradient (or one chunk) to the previous virtual stage."""
    RECV_B = "RECV_B"
    """Receive an output gradient (or one chunk) from the next virtual stage."""
    REDUCE_GRAD = "REDUCE_GRAD"
    """Reduce gradients across the data-parallel replicas of this rank's stage."""
    OPT_STEP = "OPT_STEP"
    """Apply the optimizer update; the last action of an iteration."""


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
"""Kinds executed by the whole TP group of a stage together."""
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
"""Point-to-point kinds; each names its peer rank."""
_SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_GLOBAL_KINDS = frozenset({ActionKind.REDUCE_GRAD, ActionKind.OPT_STEP})

_TEXT = re.compile(
    r"^(?P<stage>\d+)(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(?P<mb>\d+)"
    r"(?:\[(?P<chunk>\d+)/(?P<nchunks>\d+)\])?(?:(?P<arrow>->|<-)r(?P<peer>\d+))?$"
)


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step in a rank's ordered action list.

    A plain value: equal actions compare equal and hash alike, so action lists can be diffed and
    used as dictionary keys by the simulator and the interpreter.
    """

    kind: ActionKind
    """What the step does."""
    stage: int | None = None
    """Virtual stage index (see [Note: send/recv stage indices]); None for REDUCE_GRAD/OPT_STEP."""
    microbatch: int | None = None
    """Global micro-batch id (replica r owns a contiguous id range); None for global steps."""
    peer: int | None = None
    """Rank of the matching endpoint of a SEND/RECV; None for every other kind."""
    chunk: int = 0
    """Which chunk of the message this transfer carries (0 when the message is not split)."""
    num_chunks: int = 1
    """Chunks the message is split into: max(TP sender, TP receiver) (ResiHP §7, Figure 7)."""

    def __post_init__(self) -> None:
        kind = ActionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if kind in _GLOBAL_KINDS:
            if (self.stage, self.microbatch, self.peer) != (None, None, None):
                raise ValueError(f"{kind} takes no stage, micro-batch or peer")
        else:
            if self.stage is None or self.microbatch is None:
                raise ValueError(f"{kind} needs a stage and a micro-batch")
            if self.stage < 0 or self.microbatch < 0:
                raise ValueError(f"{kind}: stage and micro-batch must be >= 0")
            if (kind in COMM_KINDS) != (self.peer is not None):
                raise ValueError(f"{kind}: a peer is required for SEND/RECV and only for them")
        if self.peer is not None and self.peer < 0:
            raise ValueError(f"peer rank must be >= 0, got {self.peer}")
        if self.num_chunks < 1 or not 0 <= self.chunk < self.num_chunks:
            raise ValueError(f"chunk {self.chunk} of {self.num_chunks} is out of range")
        if self.num_chunks > 1 and kind not in COMM_KINDS:
            raise ValueError(f"{kind} cannot be chunked; only SEND/RECV are")

    @property
    def is_compute(self) -> bool:
        """True for F, B and W: executed by every rank of the stage's TP group together."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for SEND/RECV actions."""
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self.kind in _SEND_KINDS

    def __repr__(self) -> str:
        return f"parse_action({str(self)!r})"

    def __str__(self) -> str:
        if self.kind in _GLOBAL_KINDS:
            return str(self.kind)
        text = f"{self.stage}{self.kind}{self.microbatch}"
        if self.num_chunks > 1:
            text += f"[{self.chunk}/{self.num_chunks}]"
        if self.peer is not None:
            text += f"{'->' if self.is_send else '<-'}r{self.peer}"
        return text


def parse_action(text: str) -> Action:
    """Parse the text form written by ``str(action)``; the inverse of it.

    Args:
        text: e.g. ``"0F3"``, ``"2W1"``, ``"1SEND_F2->r5"``, ``"2RECV_B0[1/2]<-r7"``,
            ``"REDUCE_GRAD"``, ``"OPT_STEP"``.

    Returns:
        The action.

    Raises:
        ValueError: the text is not a valid action, or a send is written with ``<-`` or a
            receive with ``->``.
    """
    text = text.strip()
    if text in (ActionKind.REDUCE_GRAD, ActionKind.OPT_STEP):
        return Action(ActionKind(text))
    match = _TEXT.match(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. '0F3' or '1SEND_F2->r5')")
    kind = ActionKind(match["kind"])
    peer = None if match["peer"] is None else int(match["peer"])
    if match["arrow"] is not None and (match["arrow"] == "->") != (kind in _SEND_KINDS):
        raise ValueError(f"{text!r}: sends are written '->rN', receives '<-rN'")
    chunk, nchunks = (
        (0, 1) if match["chunk"] is None else (int(match["chunk"]), int(match["nchunks"]))
    )
    return Action(kind, int(match["stage"]), int(match["mb"]), peer, chunk, nchunks)
