"""The iteration contract: compute → protect → sync → update → boundary, on flat state.

`TrainState` holds the flat buffers (parameters, gradients, AdamW moments) that later live in
the state manager's retained memory; `Trainer` runs one iteration over them, calling phase hooks
at every boundary (fault injection, protection, metrics attach there).
"""

from unbroken.train.loop import BatchSource, IterationResult, LossFn, Trainer, reference_loss
from unbroken.train.optim import AdamW, lr_at
from unbroken.train.phases import Phase, PhaseHook
from unbroken.train.state import TrainState

__all__ = [
    "AdamW",
    "BatchSource",
    "IterationResult",
    "LossFn",
    "Phase",
    "PhaseHook",
    "TrainState",
    "Trainer",
    "lr_at",
    "reference_loss",
]
