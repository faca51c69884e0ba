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
    iterations = 44 if quick else 74
    faults = [
        "kill:rank=1,iter=8,phase=update",
        "pageloss:rank=2,iter=15,phase=writeback,pages=2,parity=1",
        "exception:rank=0,iter=20,phase=backward",
        # A persistent fail-slow: rank 3 computes 3x slower from here on; the workload-aware
        # detector must find it (and not the swings of variable-length data). Sixteen slow
        # iterations, from eight after the last recovery: on a shared 2-core machine four
        # ranks share the cores (the slowed rank's stall lends the others CPU: the iteration
        # grows ~1.45x) and the swings are ~20%, so the new level took up to 16 points to
        # win (docs/detect.md, "late changes").
        f"slow:rank=3,iter={iterations - 16},factor=3",
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
