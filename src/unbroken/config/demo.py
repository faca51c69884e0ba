"""The demo job (`unbroken demo`), as data: the small model on 4 ranks with failures spread over
the run. Kept here, beside the configs it is made of, so the demo command and the benchmarks that
start from the same job (`unbroken bench recovery`, `bench/rmu_overhead.py`) share one
definition without the benchmarks importing the CLI."""

from __future__ import annotations

from unbroken.config.job import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    TrainConfig,
)

__all__ = ["demo_config"]


def demo_config(quick: bool) -> JobConfig:
    """The demo job: small model, 4 ranks, failures spread over the run."""
    iterations = 36 if quick else 66
    faults = [
        "kill:rank=1,iter=8,phase=update",
        "pageloss:rank=2,iter=15,phase=writeback,pages=2,parity=1",
        "exception:rank=0,iter=20,phase=backward",
        # A persistent fail-slow: rank 3 computes 3x slower from here on; the workload-aware
        # detector must find it (and not the swings of variable-length data). A dozen slow
        # iterations: on a shared 2-core machine the swings are large and the change point
        # needs several points past the recovery grace to stand out.
        f"slow:rank=3,iter={iterations - 12},factor=3",
    ]
    if not quick:
        faults += [
            "hang:rank=3,iter=33,phase=sync",
            # More pages than the first tier tolerates: detected, recovered by checkpoint.
            "pageloss:rank=1,iter=45,phase=parity,pages=6",
            "kill:rank=0,iter=52,phase=marker",
        ]
    return JobConfig(
        model=ModelConfig(preset="small"),
        data=DataConfig(tokens_per_microbatch=256, microbatches=2),
        train=TrainConfig(iterations=iterations, lr=1e-3),
        parallel=ParallelConfig(world_size=4),
        checkpoint=CheckpointConfig(mttf_s=10.0),
        recovery=RecoveryConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0),
        inject=faults,
    )
