"""A generation's training loop on one rank: iterations from the restored start to the end,
with what each iteration leaves behind — the fail-slow timings, checkpoints when the policy
says so, the state hash, rank 0's metrics row, and a heartbeat that says it completed.

`with_reclamation` wraps the executor's iteration in Leto's allocation-failure path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.checkpoint.policy import CheckpointPolicy
from unbroken.config import JobConfig
from unbroken.launch.audit import Audit, gather_hashes, replica_mismatches
from unbroken.launch.executor import Executor
from unbroken.metrics.log import JsonlLog
from unbroken.train import IterationResult

__all__ = ["TrainingLoop", "with_reclamation"]


@dataclass(slots=True)
class TrainingLoop:
    """Args: cfg, generation, executor, checkpoints (the policy), timings (the job's
    `timings.jsonl`), metrics (`metrics.jsonl`, rank 0 only), iterate (the executor's
    `run_iteration`, possibly wrapped), group, events, heartbeat (None without an agent)."""

    cfg: JobConfig
    generation: int
    executor: Executor
    checkpoints: CheckpointPolicy
    timings: JsonlLog
    metrics: JsonlLog | None
    iterate: Callable[[int], IterationResult]
    group: Any = None
    """The job's process group (the audit gathers every rank's hash over it)."""
    events: Any = None
    """The job's event log (rank 0 reports replica mismatches there)."""
    heartbeat: Any = None
    switch: Any = None
    """Agrees on the placement at each boundary (`unbroken.launch.switch`; None: fixed)."""
    devices: list[int] | None = None
    """rank -> device, written into every metrics row when the world may change (the audit
    compares a rank's hash with the reference rank that ran on the same device)."""

    def run(self, start: int) -> None:
        state = self.executor.state
        self.checkpoints.before_loop(state, start)
        for it in range(start, self.cfg.train.iterations):
            result = self.iterate(it)
            record = self.executor.timing_record(it, result)
            if record is not None:
                # Per-rank compute timings and workload, for fail-slow validation.
                self.timings.write({**record, "generation": self.generation})
            ckpt_s = self.checkpoints.after_iteration(state, it, result.seconds)
            audit = self._hash(it)
            if self.metrics is not None:
                self._write_metrics(result, audit, ckpt_s)
            if self.heartbeat is not None:
                self.heartbeat.completed(it)
            if self.switch is not None and it + 1 < self.cfg.train.iterations:
                self.switch.at_boundary(it)
        self.checkpoints.flush()  # a background save the generation started is sealed

    def _hash(self, it: int) -> Audit | None:
        """The audit at hashed iterations (`train.hash_every`; the last one always): every
        rank hashes its own state and the hashes are gathered (a collective every rank joins;
        the condition is the same on every rank). A replica that differs from its peers is
        logged by rank 0 with the iteration."""
        every = self.cfg.train.hash_every
        if not every or (it % every and it != self.cfg.train.iterations - 1):
            return None
        audit = self.audit()
        if audit.mismatched and self.metrics is not None:
            self.events.emit("replica_mismatch", iter=it, ranks=audit.mismatched)
        return audit

    def audit(self) -> Audit:
        """Gather every rank's hash (collective)."""
        ex = self.executor
        hashes = gather_hashes(ex.rank_hash(), self.group)
        return Audit(ex.job_hash(hashes), hashes, replica_mismatches(hashes, ex.replica_sets))

    def _write_metrics(self, result: IterationResult, audit: Audit | None, ckpt_s: float) -> None:
        assert self.metrics is not None
        t_end = time.time()
        self.metrics.write(
            {
                "iter": result.iteration,
                "generation": self.generation,
                "t_start": result.t_start,
                "t_end": t_end,
                "iter_s": t_end - result.t_start,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "tokens": result.tokens,
                "tokens_per_s": result.tokens / max(1e-9, t_end - result.t_start),
                "state_hash": audit.job_hash if audit else None,
                "rank_hashes": audit.rank_hashes if audit else None,
                "ckpt_s": ckpt_s,
                "doc_lengths": [list(x) for x in result.doc_lengths],
                **({"devices": self.devices} if self.devices is not None else {}),
                **self._lent(),
            }
        )

    def _lent(self) -> dict[str, Any]:
        """Rank 0's lending pool (`unbroken.update.lending`): bytes lent, and the most of them
        the compute phase has held (a GPU job with `protection.lend_activations`)."""
        lending = getattr(self.executor.updater, "lending", None)
        if lending is None:
            return {}
        st = lending.stats()
        return {"lent_bytes": st.lent_bytes, "lent_peak": st.lent_peak}


def with_reclamation(executor: Executor, client, heartbeat, events, rank: int, device):
    """`executor.run_iteration` with Leto's allocation-failure path: an OOM in forward/backward
    (the model state untouched, gradients re-zeroed by the retry) asks the agent to reclaim the
    shadows and computes the iteration again; anything else, or nothing left to reclaim, is
    raised (a crash, recovered in place)."""
    import torch

    def iterate(it: int) -> IterationResult:
        freed_retry = True
        while True:
            try:
                return executor.run_iteration(it)
            except (torch.OutOfMemoryError, MemoryError) as exc:
                phase = heartbeat.phase
                if heartbeat.iteration != it or phase not in ("forward", "backward"):
                    raise
                used = total = None
                if device.type == "cuda":
                    before = torch.cuda.memory_reserved(device)
                    torch.cuda.empty_cache()
                    free, total = torch.cuda.mem_get_info(device)
                    used = total - free
                    # Inside a lent compute phase torch cannot free its default pool's cache
                    # (`unbroken.update.lending`): what the cache held may be enough. Once.
                    if freed_retry and torch.cuda.memory_reserved(device) < before:
                        freed_retry = False
                        events.emit("oom_retry", rank=rank, iter=it, phase=phase, freed=True)
                        continue
                t0 = time.time()
                answer = client.request(
                    f"{type(exc).__name__} in {phase}", used, total, iteration=it
                )
                events.emit(
                    "oom_retry",
                    rank=rank,
                    iter=it,
                    phase=phase,
                    reclaimed=answer.reclaimed,
                    wait_s=time.time() - t0,
                )
                if not answer.reclaimed:
                    raise

    return iterate
