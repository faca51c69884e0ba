"""The worker interpreter: runs one rank's action list of a `ParallelPlan` for one iteration.

`PlanWorker.run_iteration` walks the rank's actions in order and keeps the iteration contract
of `unbroken.train` (compute → protect → sync → update → boundary):

- ``F``/``B``/``W``: forward, backward, weight-gradient of one micro-batch through one virtual
  stage of the rank's `StageModel` (TP collectives inside);
- a run of ``SEND_*``/``RECV_*``: one batch, posted together and waited for
  (`unbroken.engine.transfer`, [Note: chunked messages]);
- ``REDUCE_GRAD``: end of the compute phase; gradients averaged over the DP group, as the
  reference trainer does (all-reduce, then divide by the replica count), or at the finest shard
  when replica layouts differ (`unbroken.engine.dp_sync`);
- ``OPT_STEP``: protect, sync (loss and global gradient norm over the world), the updater's
  chunked AdamW over the flat state, boundary — the same `updater` object the single-process
  trainer uses (`PlainUpdater`, or the resumable one of in-place recovery).

Split backward (ZB-H1): when the rank's list holds ``kW m`` for a ``kB m``, B runs the backward
with the stage's `WeightGradSink` open, so it computes the input gradient (and the cheap norm and
embedding gradients) and defers the linear weight GEMMs to W ([Note: split backward] in
`unbroken.engine.wgrad`). Without a W, B is the full backward.

[Note: loss scale] Each micro-batch's loss is divided by (total micro-batches / replicas), which
is the reference trainer's `loss / len(batches)` when replicas own equal counts, and the
gradient all-reduce over replicas is divided by the replica count as there.

A rank of a replica that owns no micro-batch (its list is REDUCE_GRAD, OPT_STEP) still joins
the reduction and steps; every `probe_every`-th iteration it first runs the probe micro-batch
of [Note: probe micro-batch] (`unbroken.engine.probe`): its F and B are the rank's FORWARD and
BACKWARD step 0 of 1 for the phase hooks, its timings go to `StageTiming.probe`, nothing of it
is left in the state.

Gradients land in the caller's flat gradient buffer (`bind_grads`); parameters are only
updated by the updater — [Note: flat-storage] holds for every plan.

Fail-slow inputs: each iteration the worker reports the workload it computed (the segment
lengths of every micro-batch it touched, with their global ids, in the `IterationResult`) and
its own timings (`timing`, a `unbroken.detect.timing.StageTiming`): every compute action's
duration, and the iteration split into time blocked on peers (p2p batches, TP collectives,
gradient reduction, the sync all-reduce) and busy time. Measuring costs a few clock reads per
action; nothing is synchronized for it.

[Note: plan hooks] The phase hooks are called as `unbroken.train.Trainer` calls them, with the
rank's own view of the plan, so that a hook's (phase, step) means the same on every rank:

- FORWARD / BACKWARD before each F / B action: step = the rank's k-th F (B) action of the
  iteration, n_steps = how many it runs (its micro-batches, times the virtual stages it holds
  when interleaved). Each (phase, step) fires once per iteration, step 0 first. Not the global
  micro-batch id: the ranks of replica 0 never see ids past their own, so a fault's default
  step (n // 2) of the global count was never reached there. W actions have no hook (their
  time counts in the step before). A rank of an empty replica has no F or B, hence no such
  hook, except in an iteration it probes, whose probe F and B are its step 0 of 1.
- with replicas, ALLREDUCE b before each gradient-reduction bucket (one for `FineShardSync`)
  and REDUCED after the last, inside REDUCE_GRAD; then PROTECT, SYNC, UPDATE per chunk,
  BOUNDARY.

What phase hooks cannot see on a plan's rank is its time blocked on peers (a pipeline
neighbour's compute inside a p2p batch, TP collectives). A hook may define two optional
methods for it, which the fault injector's `slow` faults use ([Note: slow-fault] in
`unbroken.inject.injector`):

- ``use_busy_clock(clock)``: called once, here, with `PlanWorker.busy_clock` — seconds of the
  rank's own work (wall time minus the time blocked in p2p batches, TP collectives, the
  gradient reduction and the sync all-reduce; `StageTiming.busy_s` per iteration);
- ``after_transfer(iteration, seconds, sent)``: after each p2p batch, with its duration and
  whether it sent anything. It runs inside the batch's blocked time: a stall there is the
  rank's transfer taking longer;
- ``after_compute(iteration)``: after each F, B or W action's work, inside the action's timed
  seconds (`StageTiming.compute`): a stall there is the action taking longer, as a slower
  device's kernels would. (A stall at the next phase hook instead lands between actions, where
  the per-action timings never see it: the fail-slow watch's pace comparison, which reads
  them, then took a slowed rank for a healthy one.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from unbroken.config import TrainConfig
from unbroken.detect.timing import StageTiming
from unbroken.engine.groups import PlanGroups
from unbroken.engine.ordered_plan import PlanOrderedGradients
from unbroken.engine.probe import probe_actions, probes
from unbroken.engine.sharding import replicated, shard_of
from unbroken.engine.stage import MicroBatchInputs, StageModel
from unbroken.engine.transfer import run_batch
from unbroken.engine.wgrad import WeightGradSink
from unbroken.parallel import Action, ActionKind, ParallelPlan
from unbroken.train import BatchSource, IterationResult, Phase, PhaseHook, TrainState
from unbroken.train.tail import Updater, finish_iteration

__all__ = ["PlanWorker"]

_REDUCE_BUCKET = 1 << 25
_LAYER = re.compile(r"layers\.(\d+)\.")
_K = ActionKind


def _hook_steps(actions: Sequence[Action]) -> dict[tuple[ActionKind, int, int], tuple[int, int]]:
    """(kind, virtual stage, micro-batch) of each F and B action -> (step, n_steps) of its
    phase hook: its place among the rank's actions of that kind ([Note: plan hooks])."""
    kinds = (_K.F, _K.B)
    n = {k: sum(a.kind is k for a in actions) for k in kinds}
    seen = dict.fromkeys(kinds, 0)
    steps = {}
    for a in actions:
        if a.kind in kinds:
            steps[(a.kind, a.stage, a.microbatch)] = (seen[a.kind], n[a.kind])
            seen[a.kind] += 1
    return steps


class PlanWorker:
    """Executes one rank's actions of `plan` on its `StageModel` over flat `state`.

    Args:
        plan: the plan; this rank's list is `plan.actions[groups.rank]`.
        model: the rank's stage model, parameters materialized in `state.params` and gradients
            bound to `state.grads`.
        state: the flat buffers (caller-provided; retained memory under in-place recovery).
        source: micro-batches as a pure function of (iteration, shard); shard = owner replica.
        cfg: optimizer, schedule and clipping.
        groups: this rank's process groups for `plan`.
        updater: `protect / record_sync / update / boundary`, as for `unbroken.train.Trainer`.
        device: where to compute.
        hooks: phase hooks (fault injection, timing), called as by the trainer.
        autocast_dtype: bf16 on GPU as the trainer does, None for fp32. Messages between
            stages stay fp32 (the residual stream is fp32 under autocast).
        ordered: the ordered gradient reduction (`unbroken.engine.ordered_plan`), built over
            `state.grads`; None: the all-reduce of [Note: loss scale].
        shard_microbatches: M, micro-batches per logical data shard: micro-batch k's data is
            micro-batch k mod M of shard k // M whichever replica runs it (a plan whose
            replicas own other counts than the launch plan's reads the same data). None: the
            owner replica's shard (every replica owns the same count).
        probe_every: see the attribute.
    """

    def __init__(
        self,
        *,
        plan: ParallelPlan,
        model: StageModel,
        state: TrainState,
        source: BatchSource,
        cfg: TrainConfig,
        groups: PlanGroups,
        updater: Updater,
        device: torch.device,
        hooks: Sequence[PhaseHook] = (),
        autocast_dtype: torch.dtype | None = None,
        ordered: PlanOrderedGradients | None = None,
        shard_microbatches: int | None = None,
        probe_every: int = 0,
        norm_tp: int = 1,
    ) -> None:
        self.model, self.state, self.shard_microbatches = model, state, shard_microbatches
        self.norm_tp = norm_tp
        """TP positions per layer in the ordered norm's slots, at least: the launch plan's
        degree, which a stage computing as that group keeps (`unbroken.engine.emulate`)."""
        self.probe_every = probe_every
        """An empty replica's ranks run a probe micro-batch every this many iterations
        ([Note: probe micro-batch] in `unbroken.engine.probe`; 0: never)."""
        self.autocast_dtype = autocast_dtype
        self.source, self.cfg = source, cfg
        self.updater, self.device, self.hooks = updater, device, list(hooks)
        self.layers: dict[int, tuple[int, int]] = {}
        self._bind(plan, groups, ordered)
        self._blocked = dict.fromkeys(("p2p", "tp", "reduce", "sync"), 0.0)
        self._blocked_before = 0.0
        """Blocked seconds of the iterations before this one (`busy_clock`)."""
        self._blocked_since: float | None = None
        """Start of the blocked interval that hooks are being called inside (`busy_clock`)."""
        for hook in self.hooks:  # [Note: plan hooks]
            if (use := getattr(hook, "use_busy_clock", None)) is not None:
                use(self.busy_clock)
        self.timing: StageTiming | None = None
        """This rank's timings of the last iteration run (fail-slow detection)."""
        self.profile: dict[str, list[float]] | None = None
        """Set to a dict to collect seconds per step: ``F0``/``B1``/``W0`` (kind and virtual
        stage), ``BATCH`` (one p2p batch, waiting included), ``REDUCE_GRAD``, ``OPT_STEP``
        (protect to boundary), ``ITERATION``; for the benchmark."""

    def _bind(
        self, plan: ParallelPlan, groups: PlanGroups, ordered: PlanOrderedGradients | None
    ) -> None:
        """Take `plan`'s view of this rank: its actions, layers, loss scale and norm ranges."""
        if ordered is not None and self.shard_microbatches is None:
            raise ValueError("the ordered reduction needs shard_microbatches")
        self.plan, self.groups, self.ordered = plan, groups, ordered
        self.rank = groups.rank
        self.actions = plan.actions.get(self.rank, ())
        layers = {}
        if self.actions:
            d, s = plan.locate(self.rank)
            rep = plan.replicas[d]
            layers = {k: g.layers for k, g in enumerate(rep.stages) if k % plan.pp == s}
        if self.layers and layers != self.layers:
            raise ValueError(
                f"rank {self.rank}: a live plan switch keeps each rank's layers "
                f"(held {self.layers}, the new plan gives {layers})"
            )
        self.layers = layers
        self.last_stage = plan.num_stages - 1
        self.split = {(a.stage, a.microbatch) for a in self.actions if a.kind is _K.W}
        self.loss_div = plan.total_microbatches / plan.dp
        self.loss_shards = plan.dp
        """The sync divides the summed loss by it: replicas, or logical shards when ordered."""
        if ordered is not None:
            assert self.shard_microbatches is not None
            self.loss_div = self.shard_microbatches
            self.loss_shards = plan.total_microbatches // self.shard_microbatches
        self.reports_loss = groups.tp.rank == 0 and any(
            a.kind is _K.F and a.stage == self.last_stage for a in self.actions
        )
        self._norm_tp = max(self.norm_tp, *(g.tp for rep in plan.replicas for g in rep.stages))
        """TP positions per layer in the ordered norm's slots: the plan's largest TP degree, or
        the launch plan's (`norm_tp`)."""
        self._loss_slots = plan.total_microbatches if ordered is not None else 0
        """Per-micro-batch loss slots of the sync (ordered: the loss is folded in id order)."""
        self._norm_slots = (plan.num_layers + 2) * self._norm_tp if ordered is not None else 0
        """Per-(layer, TP position) squared-norm slots of the sync (ordered)."""
        self._counted = self._norm_slices() if ordered is None else []
        self._buckets = self._norm_buckets() if ordered is not None else []
        self._steps = _hook_steps(self.actions)
        self._probe_list = probe_actions(plan, self.rank) if self.rank in plan.ranks else ()
        self._probing = False

    def set_plan(
        self, plan: ParallelPlan, groups: PlanGroups, ordered: PlanOrderedGradients | None
    ) -> None:
        """Run `plan` from the next iteration on (a live re-plan at an iteration boundary that
        moves micro-batches, not layers: `unbroken.engine.build.switch_plan` builds its groups).

        Raises:
            ValueError: the plan gives this rank other layers (its state would not match).
        """
        self._bind(plan, groups, ordered)

    # -- helpers ----------------------------------------------------------------------------
    def _hook(self, phase: Phase, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        for hook in self.hooks:
            hook(phase, iteration, step, n_steps)

    def busy_clock(self) -> float:
        """Seconds of this rank's own work so far: wall time minus the time blocked on peers
        ([Note: plan hooks]); it stands still while the rank waits."""
        now = time.perf_counter() if self._blocked_since is None else self._blocked_since
        return now - self._blocked_before - sum(self._blocked.values())

    def _transferred(self, iteration: int, seconds: float, sent: bool) -> None:
        for hook in self.hooks:  # [Note: plan hooks]
            if (after := getattr(hook, "after_transfer", None)) is not None:
                after(iteration, seconds, sent)

    def _norm_slices(self) -> list[tuple[int, int]]:
        """Flat ranges this rank adds to the global gradient norm: its replica-0 shards, with
        replicated tensors counted on TP position 0 only (each element once)."""
        if not self.actions or self.plan.locate(self.rank)[0] != 0:
            return []
        ranges: list[tuple[int, int]] = []
        open_range = False  # consecutive counted slots merge (the padding between is zero)
        for s in sorted(self.state.layout.slots, key=lambda s: s.offset):
            if self.groups.tp.rank == 0 or not replicated(s.name):
                if open_range:
                    ranges[-1] = (ranges[-1][0], s.offset + s.numel)
                else:
                    ranges.append((s.offset, s.offset + s.numel))
                open_range = True
            else:
                open_range = False
        return ranges

    def _norm_buckets(self) -> list[tuple[int, int, int, tuple | None]]:
        """(bucket, lo, hi, piece) of every flat range this rank adds to the gradient norm when
        the reduction is ordered: bucket = (the layer a parameter belongs to — n_layers: the
        embedding; n_layers + 1: the rest) x the TP degrees + this rank's TP position, so the
        norm is a fold over layers and shards in a fixed order whatever stage and replica hold
        them, each slot from one rank ([Note: ordered reduction]). A stage computing as a
        TP group (`unbroken.engine.emulate`) adds each position's shard to that position's
        bucket: piece = (name, shape, degree, position), the `shard_of` of the whole tensor."""
        if not self.actions or self.plan.locate(self.rank)[0] != 0:
            return []
        n, t = self.plan.num_layers, self._norm_tp
        e = getattr(self.model, "emulate", 1)
        positions = range(e) if e > 1 else (self.groups.tp.rank,)
        out = []
        for s in sorted(self.state.layout.slots, key=lambda s: s.offset):
            found = _LAYER.search(s.name)
            layer = int(found.group(1)) if found else (n if "embed" in s.name else n + 1)
            whole = replicated(s.name)
            for pos in positions:
                if pos != 0 and whole:
                    continue  # replicated: counted on position 0 only
                piece = (s.name, s.shape, e, pos) if e > 1 and not whole else None
                out.append((layer * t + pos, s.offset, s.offset + s.numel, piece))
        return out

    def _microbatch(self, iteration: int, mb: int) -> Any:
        if self.shard_microbatches is None:
            shard = self.plan.owner(mb)
            index = mb - self.plan.microbatch_ids(shard).start
        else:
            shard, index = divmod(mb, self.shard_microbatches)
        batches = self._batches.get(shard)
        if batches is None:
            batches = self._batches[shard] = self.source.iteration(iteration, shard)
        return batches[index]

    def _inputs(self, iteration: int, mb: int) -> MicroBatchInputs:
        if mb not in self._mb_inputs:
            batch = self._microbatch(iteration, mb)
            self._mb_inputs[mb] = MicroBatchInputs.of(batch, self.device)
        return self._mb_inputs[mb]

    def _numel(self, mb: int) -> int:
        return self._inputs(self._iteration, mb).tokens.shape[0] * self.model.args.dim

    def _payload(self, a: Action) -> torch.Tensor:
        if a.kind is _K.SEND_F:
            return self._outputs[(a.stage, a.microbatch)].detach().reshape(-1)
        return self._input_grads[(a.stage, a.microbatch)].reshape(-1)

    # -- compute ----------------------------------------------------------------------------
    def _forward(self, iteration: int, k: int, mb: int) -> None:
        inputs = self._inputs(iteration, mb)
        x = None
        if k > 0:
            got = self._received.pop((_K.RECV_F, k, mb), None)
            if got is None:  # the previous virtual stage ran on this rank
                got = self._outputs[(k - 1, mb)].detach()
            x = got.view(inputs.tokens.shape[0], -1).requires_grad_()
            self._stage_inputs[(k, mb)] = x
        if self.autocast_dtype is None:
            out = self.model(self.layers[k], x, inputs)
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                out = self.model(self.layers[k], x, inputs)
        if k == self.last_stage:
            out = out / self.loss_div
            if self.reports_loss and not self._probing:  # float64 on the device: no host sync
                if self.ordered is not None:  # folded in id order (_sync)
                    self._mb_loss[mb] = out.detach().double()
                else:
                    self._loss += out.detach().double()
                self._tokens += int(getattr(self._microbatch(iteration, mb), "n_tokens", 0))
        self._outputs[(k, mb)] = out

    def _output_grad(self, k: int, mb: int) -> torch.Tensor | None:
        if k == self.last_stage:
            return None
        got = self._received.pop((_K.RECV_B, k, mb), None)
        if got is None:  # the next virtual stage ran on this rank
            got = self._input_grads.pop((k + 1, mb))
        return got.view_as(self._outputs[(k, mb)])

    def _backward(self, k: int, mb: int) -> None:
        grad = self._output_grad(k, mb)
        out = self._outputs.pop((k, mb))
        sink = self.model.wgrad
        if (k, mb) in self.split:  # [Note: split backward]: weight GEMMs wait for W
            self._pending_w[(k, mb)] = sink.open()
        try:
            torch.autograd.backward(out, grad)
        finally:
            sink.close()
        x = self._stage_inputs.pop((k, mb), None)
        if x is not None:
            self._input_grads[(k, mb)] = x.grad
        if self.ordered is not None and not self._probing:  # one B per micro-batch
            self.ordered.keep(mb)  # (`check_ordered_plan`)

    def _weight(self, k: int, mb: int) -> None:
        WeightGradSink.run(self._pending_w.pop((k, mb)))

    # -- reductions ------------------------------------------------------------------------
    def _reduce_grads(self, iteration: int) -> None:
        """REDUCE_GRAD, timed as blocked, with ALLREDUCE / REDUCED hooks around its buckets
        ([Note: plan hooks]). The first ALLREDUCE hook is outside the blocked time (a hook
        there acts for the step before); the later ones and REDUCED are inside it (a hook there
        acts for the bucket before: a stall is the reduction taking longer)."""
        g, grads = self.groups, self.state.grads
        if self.ordered is not None:
            t = self._blocked_since = time.perf_counter()
            try:
                self.ordered.reduce(self._hook, iteration)
            finally:
                self._blocked["reduce"] += time.perf_counter() - t
                self._blocked_since = None
            return
        if g.fine is None and (g.dp is None or g.dp_size == 1):
            return
        starts = range(0, grads.numel(), _REDUCE_BUCKET) if g.fine is None else range(1)
        self._hook(Phase.ALLREDUCE, iteration, 0, len(starts))
        t = self._blocked_since = time.perf_counter()
        try:
            if g.fine is not None:
                g.fine.reduce(self.state.layout.views(grads))
            else:
                for b, a in enumerate(starts):
                    if b:
                        self._hook(Phase.ALLREDUCE, iteration, b, len(starts))
                    dist.all_reduce(grads[a : a + _REDUCE_BUCKET], group=g.dp)
                grads.div_(g.dp_size)
            self._hook(Phase.REDUCED, iteration)
        finally:
            self._blocked["reduce"] += time.perf_counter() - t
            self._blocked_since = None

    def _sync(self, iteration: int) -> tuple[float, float, float]:
        self._hook(Phase.SYNC, iteration)
        grads, f64 = self.state.grads, torch.float64
        slots = self._loss_slots
        t = torch.zeros(3 + slots + self._norm_slots, dtype=f64, device=self.device)
        for lo, hi in self._counted:
            t[1] += grads[lo:hi].to(f64).square().sum()
        for b, lo, hi, piece in self._buckets:
            g = grads[lo:hi]
            if piece is not None:  # an emulated position's shard, as that position holds it
                name, shape, e, pos = piece
                g = shard_of(g.view(shape), name, e, pos).contiguous().reshape(-1)
            t[3 + slots + b] += g.to(f64).square().sum()
        t[0] += self._loss
        t[2] += self._tokens
        for mb, loss_mb in self._mb_loss.items():  # one holder per slot: the sum is exact
            t[3 + mb] += loss_mb
        t_sync = time.perf_counter()
        dist.all_reduce(t, group=self.groups.world)
        self._blocked["sync"] += time.perf_counter() - t_sync
        total, sq = float(t[0]), float(t[1])
        if slots:  # folds in micro-batch and layer order, whatever the plan
            values = t[3:].tolist()  # ([Note: ordered reduction] in `engine.ordered_plan`)
            total = sq = 0.0
            for value in values[:slots]:
                total += value
            for value in values[slots:]:
                sq += value
        loss, norm = total / self.loss_shards, sq**0.5
        self._tokens = int(t[2])
        clip = self.cfg.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        return loss, norm, scale

    # -- the iteration ---------------------------------------------------------------------
    def _reset(self, iteration: int) -> None:
        self._blocked_before += sum(self._blocked.values())
        self._iteration = iteration
        self._batches: dict[int, Any] = {}
        self._mb_inputs: dict[int, MicroBatchInputs] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._stage_inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._received: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self._pending_w: dict[tuple[int, int], list] = {}
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._mb_loss: dict[int, torch.Tensor] = {}
        self._tokens = 0
        self._blocked = dict.fromkeys(("p2p", "tp", "reduce", "sync"), 0.0)
        self._p2p_min = float("inf")
        self._compute_s: list[tuple[str, int, int, float]] = []
        self._probe_s: list[tuple[str, int, int, float]] = []

    def _batch(self, batch: list[Action]) -> None:
        t = self._blocked_since = time.perf_counter()
        try:
            self._received.update(
                run_batch(
                    batch,
                    world=self.groups.world,
                    tp=self.groups.tp,
                    payload=self._payload,
                    numel=self._numel,
                    num_stages=self.plan.num_stages,
                    num_microbatches=self.plan.total_microbatches,
                    dtype=self.state.params.dtype,
                    device=self.device,
                )
            )
            sent = any(a.kind in (_K.SEND_F, _K.SEND_B) for a in batch)
            self._transferred(self._iteration, time.perf_counter() - t, sent)
            took = time.perf_counter() - t
        finally:
            self._blocked_since = None
        self._blocked["p2p"] += took
        self._p2p_min = min(self._p2p_min, took)
        self._record("BATCH", t)
        for a in batch:  # a sent input gradient is not needed any more (all of this rank's
            if a.kind is _K.SEND_B:  # chunks of one message are in the same batch)
                self._input_grads.pop((a.stage, a.microbatch), None)

    def _compute(self, iteration: int, a: Action) -> None:
        if a.kind is not _K.W:  # [Note: plan hooks]; a probe is its rank's one step
            phase = Phase.FORWARD if a.kind is _K.F else Phase.BACKWARD
            step = (0, 1) if self._probing else self._steps[(a.kind, a.stage, a.microbatch)]
            self._hook(phase, iteration, *step)
        t, tp0 = time.perf_counter(), self.groups.tp.clock.seconds
        if a.kind is _K.F:
            self._forward(iteration, a.stage, a.microbatch)
        elif a.kind is _K.B:
            self._backward(a.stage, a.microbatch)
        else:
            self._weight(a.stage, a.microbatch)
        # The action's TP collectives are blocked time before a hook reads the busy clock.
        self._blocked["tp"] += self.groups.tp.clock.seconds - tp0
        for hook in self.hooks:  # [Note: plan hooks]
            if (after := getattr(hook, "after_compute", None)) is not None:
                after(iteration)
        took = (a.kind.value, a.stage, a.microbatch, time.perf_counter() - t)
        (self._probe_s if self._probing else self._compute_s).append(took)

    def _run_probe(self, iteration: int) -> None:
        """The probe micro-batch ([Note: probe micro-batch] in `unbroken.engine.probe`): its
        compute timed apart, and nothing of it left: gradients zeroed, RNG state restored, its
        data and activations dropped. The phase hooks see its F and B as the rank's step 0 of
        1 ([Note: plan hooks]): a slow device is slow for the probe too, and a fault injected
        on the rank keeps its clock (an injected slowdown's `until`)."""
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._probing = True
        try:
            self._run_list(iteration, self._probe_list)
        finally:
            self._probing = False
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
        self.state.grads.zero_()
        self._batches.clear()
        self._mb_inputs.clear()
        self._outputs.clear()
        self._input_grads.clear()
        self._stage_inputs.clear()

    def _run_list(self, iteration: int, actions: Sequence[Action]) -> None:
        """Compute actions one by one, consecutive transfers as one p2p batch."""
        batch: list[Action] = []
        for a in actions:
            if a.is_comm:
                batch.append(a)
                continue
            if batch:
                self._batch(batch)
                batch = []
            t = time.perf_counter()
            self._compute(iteration, a)
            self._record(f"{a.kind}{a.stage}", t)
        if batch:
            self._batch(batch)

    def _record(self, key: str, since: float) -> None:
        if self.profile is not None:
            self.profile.setdefault(key, []).append(time.perf_counter() - since)

    def _finish_timing(self, iteration: int, since: float, step_s: float) -> None:
        b = self._blocked
        self.timing = StageTiming(
            rank=self.rank,
            iteration=iteration,
            compute=tuple(self._compute_s),
            busy_s=time.perf_counter() - since - sum(b.values()),
            p2p_s=b["p2p"],
            p2p_min_s=0.0 if self._p2p_min == float("inf") else self._p2p_min,
            tp_s=b["tp"],
            reduce_s=b["reduce"],
            sync_s=b["sync"],
            step_s=step_s,
            probe=tuple(self._probe_s),
        )

    def run_iteration(self, iteration: int) -> IterationResult:
        """Run this rank's action list once: compute, reduce, sync, update.

        Raises:
            RuntimeError: the list does not end with REDUCE_GRAD, OPT_STEP.
        """
        t0 = time.time()
        t_iter = time.perf_counter()
        self._reset(iteration)
        if not self.actions:
            # A standby (a rank of no stage: a TP exclusion's in the world) takes part in the
            # world-wide sync, and its updater marks the iteration done like every rank's (its
            # state is empty): an in-place restart agrees on one boundary over all markers.
            stats = finish_iteration(
                self.updater, self._hook, self.cfg, iteration, lambda: self._sync(iteration)
            )
            self._finish_timing(iteration, t_iter, step_s=0.0)
            return IterationResult(
                iteration, stats.loss, stats.grad_norm, stats.lr, self._tokens, (), t0, time.time()
            )
        self.state.grads.zero_()
        tail = [a.kind for a in self.actions[-2:]]
        if tail != [_K.REDUCE_GRAD, _K.OPT_STEP]:
            raise RuntimeError(f"rank {self.rank}: action list must end REDUCE_GRAD, OPT_STEP")
        self._run_list(iteration, self.actions[:-2])
        if probes(self.plan, self.rank, iteration, self.probe_every):
            self._run_probe(iteration)
        t = time.perf_counter()
        self._reduce_grads(iteration)
        self._record("REDUCE_GRAD", t)
        t = time.perf_counter()
        stats = finish_iteration(
            self.updater, self._hook, self.cfg, iteration, lambda: self._sync(iteration)
        )
        step_s = time.perf_counter() - t - self._blocked["sync"]
        self._record("OPT_STEP", t)
        self._record("ITERATION", t_iter)
        self._finish_timing(iteration, t_iter, step_s)
        if self._outputs or self._pending_w or self._input_grads or self._received:
            left = sorted(self._outputs) + sorted(self._pending_w) + sorted(self._input_grads)
            raise RuntimeError(f"rank {self.rank}: work left over at the end: {left}")
        ids = tuple(sorted(self._mb_inputs))
        return IterationResult(
            iteration=iteration,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            tokens=self._tokens,
            doc_lengths=tuple(
                tuple(int(x) for x in getattr(self._microbatch(iteration, mb), "doc_lengths", ()))
                for mb in ids
            ),
            t_start=t0,
            t_end=time.time(),
            microbatches=ids,
        )
