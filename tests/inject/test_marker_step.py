"""A `phase=marker` fault without `step=` fires at the update's first commit write, whatever the
number of chunk transactions (a GPU job's small state is one transaction of 2 MiB pages: its
update never writes SYNCED, and such a fault never fired — found by the GPU soak)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from unbroken.inject import InjectedFault, Injector, parse_fault
from unbroken.jobstore import JobStore
from unbroken.train.phases import Phase
from unbroken.update.marker import Stage


def _update_hooks(transactions: int):
    """The hook calls of one update, in the resumable updater's order."""
    n = len(Stage)
    for k in range(transactions):
        yield Phase.MARKER, int(Stage.CHUNK_UPDATING), n
        yield Phase.UPDATE, k, transactions
        yield Phase.PARITY, k, transactions
        yield Phase.MARKER, int(Stage.PARITY_READY), n
        yield Phase.WRITEBACK, k, transactions
        last = Stage.IDLE if k + 1 == transactions else Stage.SYNCED
        yield Phase.MARKER, int(last), n


def _fired_at(spec: str, transactions: int):
    inj = Injector(
        [parse_fault(spec)],
        rank=0,
        store=JobStore(dist.HashStore()),
        emit=lambda kind, **f: None,
        job_t0=0.0,
    )
    for it in range(3):
        for i, (phase, step, n) in enumerate(_update_hooks(transactions)):
            try:
                inj(phase, it, step, n)
            except InjectedFault:
                return it, i, step
    return None


@pytest.mark.parametrize(
    ("transactions", "hook", "stage"),
    [(1, 5, Stage.IDLE), (3, 5, Stage.SYNCED)],  # transaction 0's commit, as before with many
)
def test_a_marker_fault_fires_at_the_first_commit_of_the_update(transactions, hook, stage):
    assert _fired_at("exception:rank=0,iter=1,phase=marker", transactions) == (1, hook, stage)


def test_a_marker_fault_with_a_step_fires_at_that_stage_only():
    spec = f"exception:rank=0,iter=2,phase=marker,step={int(Stage.PARITY_READY)}"
    assert _fired_at(spec, 1) == (2, 3, Stage.PARITY_READY)
    assert _fired_at(f"exception:rank=0,iter=2,phase=marker,step={int(Stage.SYNCED)}", 1) is None
