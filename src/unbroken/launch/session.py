"""A rank session: the life of one trainer process, stage by stage.

    STARTED ─▶ IMPORTED (L1) ─▶ RUNTIME (L2) ─▶ GROUPED (L3) ─▶ ATTACHED ─▶ RESTORED ─▶ TRAINED

- IMPORTED: the interpreter is up with every trainer import (`TRAINER_IMPORTS`).
- RUNTIME: deterministic mode, threads, the device and its runtime (CUDA context, the shadow's
  kernel warm-up), the corpus in memory.
- GROUPED: the job store and this generation's process group.
- ATTACHED: the retained state mapped (localized and remapped after a failure), the executor
  built on it once (`build_executor`), the fault injector armed.
- RESTORED: the state obtained as the spec's `RestoreMode` says (`unbroken.launch.restore`).
- TRAINED: the generation's iterations done (`TrainingLoop`), the final state hash written.

A shadow trainer (`level` L > 0, Leto §6) runs the stages up to level L, then parks until the
agent promotes it with the final spec of its generation (`Promote` on stdin), and continues from
where it parked. With `recovery.shadow_warmup = "after_trainer"` its GPU kernel warm-up (L2)
first waits for the agent's `WarmUp`: the trainer it would replace has completed an iteration
(`ShadowInbox`). Each stage may be entered only from the one before it (`IllegalStage`).
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.launch.inbox import ShadowInbox
from unbroken.launch.spec import GenerationSpec

__all__ = ["WORK", "IllegalStage", "RankArgs", "RankSession", "SessionStage"]


class SessionStage(enum.IntEnum):
    STARTED = 0
    IMPORTED = 1
    RUNTIME = 2
    GROUPED = 3
    ATTACHED = 4
    RESTORED = 5
    TRAINED = 6


WORK = {
    SessionStage.STARTED: "imports",
    SessionStage.IMPORTED: "runtime",
    SessionStage.RUNTIME: "group",
    SessionStage.GROUPED: "attach",
    SessionStage.ATTACHED: "restore",
    SessionStage.RESTORED: "training",
    SessionStage.TRAINED: "exit",
}
"""What a session reached `stage` is doing next (where a failure happened)."""


class IllegalStage(RuntimeError):
    """A stage entered out of order (a bug)."""


@dataclass(frozen=True, slots=True)
class RankArgs:
    """How the agent started this trainer."""

    rank: int
    heartbeat: str | None = None
    """The agent's heartbeat socket (None: no agent, e.g. in tests)."""
    reclaim: str | None = None
    """The agent's reclamation socket."""
    shadow: int = 0
    """Pre-initialize to this level and park (0: an active trainer)."""
    attempt: int = 0
    """Which set of shadows of its generation (each rendezvouses under its own prefix)."""


def steps_footprint(steps: dict[str, float]) -> dict[int, int]:
    """Level -> private bytes measured when the shadow reached it (from `steps`)."""
    return {lv: int(steps[f"bytes-L{lv}"]) for lv in (1, 2, 3) if f"bytes-L{lv}" in steps}


@dataclass(slots=True)
class RankSession:
    spec: GenerationSpec
    args: RankArgs
    stage: SessionStage = SessionStage.STARTED
    t_start: float = field(default_factory=time.time)
    steps: dict[str, float] = field(default_factory=dict)
    """When each part of the pre-initialization was done (and a shadow's bytes per level)."""
    cfg: Any = None
    events: Any = None
    hb: Any = None
    device: Any = None
    store: Any = None
    group: Any = None
    rendezvous: Any = None
    """The generation's rendezvous store (`JobStore.generation_store`)."""
    t_group: float = 0.0
    retained: Any = None
    premapped: Any = None
    """A parked shadow's connection to its device's state manager with every region mapped
    (`MapRetained`), taken over by `attach` when it is the promoted rank's manager."""
    injector: Any = None
    executor: Any = None
    checkpoints: Any = None
    inbox: ShadowInbox = field(default_factory=ShadowInbox)
    """A shadow's lines from its agent (`WarmUp`, `MapRetained`, `Promote`)."""

    @property
    def rank(self) -> int:
        return self.args.rank

    @property
    def doing(self) -> str:
        """The stage in progress (what a failure interrupted)."""
        return WORK[self.stage]

    def _enter(self, stage: SessionStage) -> None:
        if stage != self.stage + 1:
            raise IllegalStage(f"rank {self.rank}: {self.stage.name} -> {stage.name}")
        self.stage = stage
        if stage <= self.args.shadow:  # a shadow measures what each level holds
            from unbroken.shadow.memory import private_bytes

            self.steps[f"bytes-L{int(stage)}"] = private_bytes(os.getpid())
        if stage == self.args.shadow:
            self.spec = self._await_promotion(int(stage))

    # -- the stages -----------------------------------------------------------------------
    def run(self) -> int:
        """Every stage in order; returns the process's exit status (`RankExit`)."""
        from unbroken.recovery import RankExit

        self.imports()
        self.runtime()
        self.join_group()
        self.attach()
        start = self.restore()
        if start is None:
            return RankExit.FALLBACK
        self.train(start)
        return RankExit.DONE

    def imports(self) -> None:
        """L1: the config, the job's logs and the heartbeat (every import is done by now)."""
        from unbroken.config import JobConfig, config_from_dict
        from unbroken.launch.heartbeat import Heartbeat
        from unbroken.metrics.log import JsonlLog

        spec = self.spec
        self.steps["imports"] = time.time()
        self.cfg = config_from_dict(JobConfig, spec.config, "<spec>")
        self.events = JsonlLog(Path(spec.run_dir) / "events.jsonl", run=spec.run_name)
        if self.args.heartbeat:
            self.hb = Heartbeat(
                self.args.heartbeat,
                self.rank,
                spec.generation,
                self.cfg.recovery.heartbeat_interval_s,
            )
            self.hb.start()
        self._enter(SessionStage.IMPORTED)

    def runtime(self) -> None:
        """L2: deterministic mode, threads, the device runtime, the corpus in memory."""
        import torch

        cfg = self.cfg
        # cuBLAS needs a fixed workspace to be deterministic; set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(cfg.train.threads)
        self.device = device = _device(cfg)
        if device.type == "cuda":
            # Deterministic mode fills every new allocation with NaN (~10 % of a 1b step on
            # the H200); nothing here reads memory before writing it, and the fill changes no
            # result, only the time.
            torch.utils.deterministic.fill_uninitialized_memory = False
            torch.cuda.set_device(device)
            torch.empty(1, device=device)  # the CUDA context, part of the device runtime (L2)
        if not cfg.data.dataset:
            from unbroken.data import corpus_for

            corpus_for(cfg.data)  # tokenized once before launch; trainers only map the cache
        if self.args.shadow >= 2 and device.type == "cuda" and self.spec.retains_state:
            from unbroken.shadow.warm import warm_cuda

            if cfg.recovery.shadow_warmup == "after_trainer":
                self.inbox.await_warm_up()  # not beside the first iteration of its trainer
                self.steps["warm_go"] = time.time()
            warm_cuda(cfg, device)  # library handles and codec kernels, loaded before promotion
            self.steps["warm"] = time.time()
        self.steps["runtime"] = time.time()
        self._enter(SessionStage.RUNTIME)

    def join_group(self) -> None:
        """L3: the job store and this generation's process group (a shadow set's own: a mirror
        world, so fresh processes started instead of it never meet its keys)."""
        from unbroken.jobstore import JobStore

        spec, cfg = self.spec, self.cfg
        timeout_s = cfg.recovery.collective_timeout_s
        self.store = JobStore.connect(spec.store_host, spec.store_port, timeout_s)
        self.steps["store"] = time.time()
        self._form_group(spec, self.args.attempt if self.args.shadow else None)
        self._enter(SessionStage.GROUPED)

    def _form_group(self, spec: GenerationSpec, attempt: int | None) -> None:
        """Join `spec`'s generation's process group (a shadow set's mirror world when
        `attempt` is given) as this session's rank."""
        from datetime import timedelta

        import torch.distributed as dist

        self.steps["group_start"] = time.time()
        cfg, device = self.cfg, self.device
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.rendezvous = rendezvous = self.store.generation_store(spec.generation, attempt)
        dist.init_process_group(
            backend,
            store=rendezvous,
            rank=self.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=cfg.recovery.collective_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        self.group = dist.group.WORLD
        # Every rank has read its peers' rendezvous keys once all are past the barrier: each
        # then deletes its own, so the job's store does not grow with every generation.
        dist.barrier(self.group)
        rendezvous.forget()
        self.t_group = self.steps["communicators"] = time.time()

    def attach(self) -> None:
        """The retained state (in-place recovery), the fault injector, and the executor built
        once on the retained buffers (attaching maps them and localizes lost pages first)."""

        from unbroken.inject import Injector, parse_fault
        from unbroken.recovery import RestoreMode

        spec, cfg, rank = self.spec, self.cfg, self.rank
        self.steps["attach"] = time.time()
        if spec.retains_state:
            from unbroken.launch.retained import RetainedState
            from unbroken.state.client import RetainedClient

            client = self._premapped_client(spec.state_sockets[str(rank)])
            if client is None:
                client = RetainedClient(spec.state_sockets[str(rank)], timeout_s=60)
            client.generation = spec.generation
            # A generation that restarts from a checkpoint may run another plan than the one
            # this device's regions were made for: they take the new geometry. One that moves
            # the state (RESHARD) attaches them as they are first (`restore`).
            relayout = spec.restore not in (RestoreMode.IN_PLACE, RestoreMode.RESHARD)
            self.retained = RetainedState(cfg, client, relayout=relayout)
        job_t0 = self.store.job_t0(time.time() if rank == 0 else None)
        faults = [parse_fault(f) for f in cfg.inject]
        # Faults name devices (the ranks at launch): after a device is lost the survivors run
        # under new ranks, and a fault scheduled for a device still finds it.
        device_id = spec.device_of(rank)
        self.injector = Injector(faults, device_id, self.store, self.events.emit, job_t0)
        self.injector.device = self.device
        # The state the devices hold first: a generation that moves it starts on the plan before.
        plan = spec.engine_plan_before() if spec.restore is RestoreMode.RESHARD else None
        self.executor = self._build_executor(plan or spec.engine_plan())
        self._arm()
        if spec.device_registry:
            from unbroken.inject import DeviceRegistry

            self.injector.devices = DeviceRegistry(spec.device_registry)
        # The executor's own groups (a plan's stage and DP groups) rendezvoused here too: once
        # every rank is past them, their keys go as well (every rank, even one in none of them).
        import torch.distributed as dist

        dist.barrier(self.group)
        self.rendezvous.forget()
        self.steps["attached"] = time.time()
        self._enter(SessionStage.ATTACHED)

    def _build_executor(self, plan) -> Any:
        """This rank's executor of `plan` (None: the config's) on `self.retained`, with the
        heartbeat and the injector at every phase."""
        import torch

        from unbroken.launch.executor import build_executor

        spec, cfg = self.spec, self.cfg
        autocast = None
        if self.device.type == "cuda" and cfg.train.precision in ("auto", "bf16"):
            autocast = torch.bfloat16
        # The heartbeat first: it records the phase a failure (an injected one too) happened in.
        hooks = ([self.hb] if self.hb else []) + [self.injector]
        return build_executor(
            cfg,
            rank=self.rank,
            group=self.group,
            device=self.device,
            retained=self.retained,
            hooks=hooks,
            autocast=autocast,
            search=spec.search_path,
            placement=spec.data_placement(),
            plan=plan,
        )

    def _arm(self) -> None:
        """Point the injector's state faults at the executor's buffers."""
        self.injector.bitflip_target = self.executor.state.params
        if self.retained is not None:
            self.injector.page_loss = self.retained.page_loss_target(self.executor.geometry)
            self.injector.release_retained = self.retained.client.shutdown

    def _checkpoint_policy(self) -> Any:
        from unbroken.checkpoint import checkpoint_root
        from unbroken.checkpoint.policy import CheckpointPolicy

        spec, cfg = self.spec, self.cfg
        return CheckpointPolicy(
            cfg.checkpoint,
            checkpoint_root(cfg.checkpoint.dir, spec.run_dir, spec.run_name),
            iterations=cfg.train.iterations,
            board=self.store,
            rank=self.rank,
            group=self.group,
            emit=self.events.emit,
            shard=self.executor.checkpoint_shard,
            layout=self.executor.checkpoint_layout,
            reshard=self.executor.reshard,
            rng_seed=cfg.train.seed,
        )

    def restore(self) -> int | None:
        """The state as the spec's `RestoreMode` says; the first iteration to run, or None when
        it cannot be resumed in place (the process then exits `RankExit.FALLBACK`)."""
        import dataclasses

        from unbroken.launch.restore import restore_state
        from unbroken.recovery import RestoreMode

        spec, rank = self.spec, self.rank
        moves = spec.restore is RestoreMode.RESHARD
        self.checkpoints = self._checkpoint_policy()
        start = restore_state(
            spec=dataclasses.replace(spec, restore=RestoreMode.IN_PLACE) if moves else spec,
            cfg=self.cfg,
            rank=rank,
            executor=self.executor,
            retained=self.retained,
            group=self.group,
            events=self.events,
            hook=self.executor.hook,
            checkpoints=self.checkpoints,
        )
        if start is None:
            return None
        if moves:
            self._move_state(start)
        self.injector.checkpoint_root = self.checkpoints.root
        if rank == 0:
            st = self.steps
            self.events.emit(
                "trainer_ready",
                generation=spec.generation,
                restored_iter=start,
                recovery=spec.restore.value,
                group_s=self.t_group,
                # Forming this generation's process group (its rendezvous -> every rank past
                # the group's barrier): the communicators a re-plan rebuilds (a promoted
                # shadow's, formed again for a changed world, after its promotion).
                communicators_s=round(st["communicators"] - st["group_start"], 4),
                # Attaching the retained state (mapping its regions; the executor built on
                # them, the updater's page tables and lending pool included), then restoring.
                attach_s=round(st["attached"] - st["attach"], 4),
                # Of it: the regions mapped (found premapped by the shadow: `premapped` of
                # them), lost pages localized and remapped.
                map_s=round(self.retained.map_s, 4) if self.retained else 0.0,
                premapped=self.retained.premapped if self.retained else 0,
                restore_s=round(time.time() - st["attached"], 4),
                build_s=self.executor.build_s,
            )
        self._enter(SessionStage.RESTORED)
        return start

    def _move_state(self, start: int) -> None:
        """RESHARD: the state, restored in place under the plan before, moves to the spec's
        plan between the ranks (`unbroken.launch.relayout`); the executor, the regions and the
        checkpoint policy are the new plan's from here."""
        import gc

        from unbroken.launch.relayout import copy_out, move_state
        from unbroken.launch.retained import RetainedState

        spec = self.spec
        t0 = time.perf_counter()
        held = copy_out(self.executor)
        copy_s = time.perf_counter() - t0
        client = self.retained.client
        # Nothing may keep the old regions mapped: the new geometry's replace them.
        self.executor = self.retained = self.checkpoints = None
        self.injector.bitflip_target = self.injector.page_loss = None
        gc.collect()
        self.retained = RetainedState(self.cfg, client, relayout=True)
        old_plan, new_plan = spec.engine_plan_before(), spec.engine_plan()
        self.executor, times = move_state(
            cfg=self.cfg,
            old_plan=old_plan,
            new_plan=new_plan,
            held=held,
            build_new=lambda: self._build_executor(new_plan),
            group=self.group,
            start=start,
            copy_s=copy_s,
        )
        self._arm()
        self.checkpoints = self._checkpoint_policy()
        self.events.emit(
            "state_moved",
            rank=self.rank,
            generation=spec.generation,
            iter=start,
            before=old_plan.stage_records(),
            after=new_plan.stage_records(),
            **times.to_dict(),
        )

    def train(self, start: int) -> None:
        """The generation's iterations, then the final state hash (rank 0 writes it)."""
        import torch.distributed as dist

        from unbroken.launch.loop import TrainingLoop, with_reclamation
        from unbroken.metrics.log import JsonlLog

        spec, cfg, rank = self.spec, self.cfg, self.rank
        run_dir = Path(spec.run_dir)
        iterate = self.executor.run_iteration
        if self.args.reclaim and self.hb is not None and cfg.recovery.shadow_level:
            from unbroken.shadow.client import ReclaimClient

            client = ReclaimClient(self.args.reclaim, rank, spec.generation)
            iterate = with_reclamation(
                self.executor, client, self.hb, self.events, rank, self.device
            )
        loop = TrainingLoop(
            cfg=cfg,
            generation=spec.generation,
            executor=self.executor,
            checkpoints=self.checkpoints,
            timings=JsonlLog(run_dir / "timings.jsonl", run=spec.run_name),
            metrics=JsonlLog(run_dir / "metrics.jsonl", run=spec.run_name) if rank == 0 else None,
            iterate=iterate,
            group=self.group,
            events=self.events,
            heartbeat=self.hb,
            switch=self._switch(start),
            devices=[spec.device_of(r) for r in range(spec.world_size)]
            if cfg.adapt.enabled
            else None,
        )
        loop.run(start)
        dist.barrier(group=self.group)
        final = loop.audit()  # every rank's own hash: the audit compares all of them
        if rank == 0:
            self.events.emit(
                "trainer_done",
                generation=spec.generation,
                final_state_hash=final.job_hash,
                rank_hashes=final.rank_hashes,
                replica_mismatch=final.mismatched,
                devices=[spec.device_of(r) for r in range(spec.world_size)],
            )
        if self.hb:
            self.hb.exiting()  # on purpose: the agent allows the slow teardown of the group
        dist.destroy_process_group()
        self._enter(SessionStage.TRAINED)

    def _switch(self, start: int) -> Any:
        """The boundary agreement on re-planned placements and plans (`adapt.enabled`); a
        re-planned pipeline's first iteration is logged (`plan_applied`)."""
        spec = self.spec
        if self.rank == 0 and spec.plan is not None:
            plan = spec.engine_plan()
            self.events.emit(
                "plan_applied",
                epoch=spec.plan_epoch,
                iter=start,
                stages=plan.stage_records(),
                counts=list(plan.microbatches),
                generation=spec.generation,
                devices=[spec.device_of(r) for r in range(spec.world_size)],
                switch_s=0.0,
            )
        switches = hasattr(self.executor, "set_placement") or hasattr(self.executor, "set_plan")
        if not self.cfg.adapt.enabled or not switches:
            return None
        from unbroken.launch.switch import PlacementSwitch

        spec = self.spec
        if self.rank == 0 and spec.placement is not None:
            self.events.emit(
                "plan_applied",
                epoch=spec.plan_epoch,
                iter=start,
                placement=spec.placement,
                counts=[len(ids) for ids in spec.placement["items"]],
                generation=spec.generation,
                devices=[spec.device_of(r) for r in range(spec.world_size)],
                switch_s=0.0,
            )
        return PlacementSwitch(
            self.store, self.group, self.rank, self.executor, self.events, spec.plan_epoch
        )

    # -- shadows --------------------------------------------------------------------------
    def _await_promotion(self, level: int) -> GenerationSpec:
        """A shadow parks here, pre-initialized to `level`, until the agent promotes it with
        the final spec of its generation (Leto §6: in-place preinitialization)."""
        spec = self.spec
        # What this shadow held at each level it passed (what reclaiming it at that level would
        # return): the agent's reclamation controller chooses levels by these.
        footprint = steps_footprint(self.steps)
        if self.hb is not None:
            self.hb.shadow_ready(level, footprint)
        t0 = self.t_start
        self.events.emit(
            "shadow_ready",
            rank=self.rank,
            pid=os.getpid(),
            level=level,
            generation=spec.generation,
            prepare_s=time.time() - t0,
            steps_s={
                k: round(v - t0, 4) for k, v in self.steps.items() if not k.startswith("bytes")
            },
            footprint_mb={lv: round(b / (1 << 20), 2) for lv, b in footprint.items()},
        )
        promote, t_promoted = self.inbox.await_promotion(lambda: self._premap(level))
        # Its priority is the job's again: the agent set it before promoting (`ShadowPool.promote`,
        # the job's niceness, not 0 — a job under `nice` keeps one priority for every rank).
        final = GenerationSpec.from_json(Path(promote.spec).read_text())
        if final.generation != spec.generation:
            raise RuntimeError(
                f"promoted into generation {final.generation}, prepared {spec.generation}"
            )
        if promote.rank is not None:  # the world changed: the same device, its new rank
            import dataclasses

            self.args = dataclasses.replace(self.args, rank=promote.rank)
        if self.hb is not None:
            self.hb.promoted(final.generation, promote.rank)
        if promote.regroup and self.group is not None:
            # Its shadow set's group was formed for the world it was prepared for: the
            # generation's own rendezvous now, with the final world (fresh trainers join it too).
            import torch.distributed as dist

            dist.destroy_process_group()
            self.group = None
            self._form_group(final, None)
        self.events.emit(
            "shadow_promoted",
            rank=self.rank,
            level=level,
            generation=spec.generation,
            t_promoted=t_promoted,
        )
        return final

    def _premap(self, level: int) -> None:
        """`MapRetained`: map every retained region of this shadow's device now (level 2 or 3:
        its device runtime exists), so the promoted trainer's `attach` finds them mapped. A
        failure here costs nothing but the time: the promoted trainer maps them itself."""
        from unbroken.state.client import RetainedClient, RetainedStateError

        spec = self.spec
        if level < 2 or not spec.retains_state or not self.cfg.recovery.premap:
            return
        if self.premapped is not None:
            self.premapped.close()
        t0 = time.time()
        client = None
        try:
            # No generation: the manager keeps serving the trainer still at work.
            client = RetainedClient(spec.state_sockets[str(self.rank)], timeout_s=60)
            regions = client.premap()
        except (RetainedStateError, OSError, RuntimeError) as exc:
            if client is not None:
                client.close()
            self.events.emit(
                "retained_premap_failed", rank=self.rank, generation=spec.generation, error=str(exc)
            )
            return
        self.premapped = client
        self.events.emit(
            "retained_premapped",
            rank=self.rank,
            generation=spec.generation,
            regions=len(regions),
            pages=sum(len(r.mapped_pages()) for r in regions),
            gb=round(sum(r.nbytes for r in regions) / 1e9, 3),
            s=round(time.time() - t0, 4),
        )

    def _premapped_client(self, socket_path: str) -> Any:
        """The premapped connection if it is to `socket_path`'s manager (a shadow promoted
        under another rank of the same device keeps it), else None (closed)."""
        client, self.premapped = self.premapped, None
        if client is not None and client.socket_path != str(socket_path):
            client.close()
            return None
        return client


def _device(cfg) -> Any:
    import torch

    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
