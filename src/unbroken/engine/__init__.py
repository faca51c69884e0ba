"""The hybrid-parallel engine: executes a `unbroken.parallel.ParallelPlan` on torch.distributed.

- `stage`: `StageModel`, the layers one rank holds of the reference Llama model, TP-sharded
  (Megatron column/row-parallel linears, vocabulary-parallel embedding and cross-entropy,
  attention heads and GQA groups split), built on "meta" and materialized into flat storage.
- `tp`: the TP communication (`TPGroup`, copy/reduce mappings, vocab-parallel ops).
- `sharding`: which dimension of each parameter is split; full model <-> shards.
- `groups`: `PlanGroups`, the TP and DP groups of one plan, built from an explicit world group.
- `dp_sync`: gradient averaging at the finest shard across replicas with different layouts.
- `reshard`: parameters and optimizer moments from one plan's layout to another's (re-planning).
- `wgrad`: `SplitLinear`, weight gradients deferred from B to W for ZB-H1.
- `transfer`: one batch of SEND/RECV actions, heterogeneous-TP chunking and all-gather.
- `interpreter`: `PlanWorker`, one rank's action list for one iteration under the iteration
  contract of `unbroken.train`.
- `build`: `build_worker`, everything above assembled for one rank from a config and a plan.

The plan IR stays torch-free in `unbroken.parallel`; this package is its torch runtime. Nothing
here holds module-level process-group state. See docs/engine.md.
"""

from unbroken.engine.groups import PlanGroups
from unbroken.engine.interpreter import PlanWorker
from unbroken.engine.reshard import reshard
from unbroken.engine.sharding import load_from_full, shard_of, split_dim, unshard
from unbroken.engine.stage import MicroBatchInputs, StageModel
from unbroken.engine.tp import TPGroup

__all__ = [
    "MicroBatchInputs",
    "PlanGroups",
    "PlanWorker",
    "StageModel",
    "TPGroup",
    "load_from_full",
    "reshard",
    "shard_of",
    "split_dim",
    "unshard",
]
