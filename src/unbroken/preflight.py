"""Checks of a job that need no rank: run in the CLI process before anything is launched.

`check_job` refuses, with one `UserError` line naming the key, the file and the fix, every
problem that can be found from the config alone and the model built on the meta device:

- the model against the plan: the TP degree against heads, KV heads, FFN and vocabulary sizes
  (`unbroken.engine.stage.check_tp_degree`), pipeline stages x virtual stages against layers
  (`unbroken.parallel.split_layers`; an own model's layers from its factory's stage source,
  `unbroken.engine.own_stages`), micro-batches against the schedule
  (`unbroken.engine.build.plan_from_config`: the plan the trainers will build) — the engine's
  own checks, called here instead of restated;
- parameter names: every `train.no_decay` pattern matches a parameter (a typo is loud);
- the world against the devices: on a GPU, one NCCL rank per device (devices per node x nodes;
  jobs run on one node); on the CPU at most `RANKS_PER_CORE` ranks per usable core;
- memory: an estimate per rank (retained state and parity, activations, process runtime)
  against the device (GPU) or the memory available (CPU); a warning, refused with `strict`;
- the output directory: created and written to once (a path under an existing file, or on a
  read-only file system, is refused).

Warnings (a memory estimate over the device without `strict`, a fault scheduled past the last
iteration) are printed to stderr as one line each and returned.

What it must never do: start a process, touch a device's memory, or duplicate a rule that a
component checks for itself — it calls that component.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from unbroken.config import JobConfig
from unbroken.errors import UserError

__all__ = ["RANKS_PER_CORE", "MemoryEstimate", "check_job", "estimate_memory"]

RANKS_PER_CORE = 16
"""Sanity bound of ranks per usable CPU core for a CPU job. Each rank is a trainer, a state
manager and (in place) a shadow — three processes that each import torch (~1.2 s of CPU) — and
the 2-core machines the tests run on are busy at 4-8 ranks; 16 per core is far past useful and
still refuses a typo like ``world_size = 100000`` before 300,000 processes start."""

PROCESS_BYTES = 400 << 20
"""Memory of one torch process before it allocates anything (interpreter, torch, gloo);
measured ~300-400 MiB resident for a CPU trainer. On a GPU: its CUDA context (~716 MiB)."""

CUDA_CONTEXT_BYTES = 716 << 20
"""GPU memory a CUDA context and cuBLAS hold (measured on the H200, PLATFORM-FACTS.md)."""


def _fail(source: str, key: str, problem: str, fix: str) -> UserError:
    return UserError(f"{source}: {key}: {problem}; {fix}")


# -- the model against the plan ----------------------------------------------------------------
def _plan_layers(cfg: JobConfig, source: str, search: list[str]) -> int:
    """The model's layer count for the plan, once the TP degree fits the reference model (an
    own model's count comes from its factory's stage source, which refuses a model that does
    not split)."""
    from unbroken.engine.build import model_layers
    from unbroken.engine.stage import check_tp_degree
    from unbroken.model import resolve_args

    if cfg.model.factory:
        return model_layers(cfg, search)
    args = resolve_args(cfg.model)
    try:
        check_tp_degree(args, cfg.parallel.tp)
    except ValueError as exc:
        raise _fail(
            source,
            f"parallel.tp = {cfg.parallel.tp}",
            str(exc),
            "choose a TP degree that divides it",
        ) from None
    return args.n_layers


def _check_plan(cfg: JobConfig, source: str, search: list[str]) -> None:
    """TP, PP x virtual stages and micro-batches against the model and schedule."""
    from unbroken.engine.build import plan_from_config
    from unbroken.parallel import split_layers

    p = cfg.parallel
    layers = _plan_layers(cfg, source, search)
    stages = p.pp * p.virtual_stages
    try:
        split_layers(layers, stages)
    except ValueError as exc:
        more = "its config" if cfg.model.factory else "model.n_layers"
        raise _fail(
            source,
            f"parallel.pp × parallel.virtual_stages = {p.pp} × {p.virtual_stages}",
            str(exc),
            f"use at most {layers} stages in all, or a model with more layers ({more})",
        ) from None
    try:
        plan_from_config(cfg, search)
    except ValueError as exc:
        raise _fail(
            source,
            f"data.microbatches = {cfg.data.microbatches} with parallel.schedule = {p.schedule!r}",
            str(exc),
            "change data.microbatches (or the schedule)",
        ) from None


# -- parameter names ---------------------------------------------------------------------------
def _meta_model(cfg: JobConfig, search: list[str]):
    """The job's model on the meta device (no storage), or None when a user factory cannot be
    built there (it will be built for real in the trainers)."""
    import torch

    from unbroken.model import build_model, resolve_args

    if not cfg.model.factory:
        return build_model(resolve_args(cfg.model), device="meta")
    from unbroken.engine.replica import factory_kwargs, import_object
    from unbroken.model.meta import skip_meta_init

    factory = import_object(cfg.model.factory, "model.factory", search)
    try:
        with torch.device("meta"), skip_meta_init():
            model = factory(**factory_kwargs(cfg, factory))
    except UserError:  # the factory's own one-line refusal (a missing extra, a bad config)
        raise
    except Exception:  # a factory that needs real tensors: nothing to check here
        return None
    return model if isinstance(model, torch.nn.Module) else None


def _check_no_decay(cfg: JobConfig, model, source: str) -> None:
    from unbroken.model.flat import matches_any

    if model is None or not cfg.train.no_decay:
        return
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    for i, pattern in enumerate(cfg.train.no_decay):
        if not matches_any(names, [pattern]):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise _fail(
                source,
                f"train.no_decay[{i}] = {pattern!r}",
                "matches no parameter of the model",
                f"use fnmatch patterns over its parameter names ({shown})",
            )


# -- devices -----------------------------------------------------------------------------------
def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_devices(cfg: JobConfig, cuda: bool, source: str) -> None:
    ws = cfg.parallel.world_size
    if not cuda:
        cores = _usable_cores()
        if ws > RANKS_PER_CORE * cores:
            raise _fail(
                source,
                f"parallel.world_size = {ws}",
                f"the job trains on this machine's CPU, which has {cores} usable cores; "
                f"unbroken starts at most {RANKS_PER_CORE} ranks per core "
                f"({RANKS_PER_CORE * cores} here)",
                "lower parallel.world_size (or train on GPUs: train.device)",
            )
        return
    import torch

    devices = torch.cuda.device_count()
    if devices == 0:
        raise _fail(
            source,
            f"train.device = {cfg.train.device!r}",
            "no CUDA device is visible to this process",
            'set train.device = "cpu" (or "auto"), or run where a GPU is visible',
        )
    nccl = cfg.parallel.backend in ("auto", "nccl")
    nodes = 1  # jobs run on one node (docs/architecture.md, "Processes")
    if nccl and ws > devices * nodes:
        raise _fail(
            source,
            f"parallel.world_size = {ws}",
            f"NCCL runs one rank per GPU and this job has {devices} GPU(s) per node × {nodes} node",
            f"lower parallel.world_size to at most {devices * nodes}",
        )


# -- memory ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one rank needs, by kind (the largest rank of a plan)."""

    state: int
    """Parameters, gradients, both AdamW moments; parity, undo and scratch in place."""
    activations: int
    """Saved activations of the micro-batches in flight (reference model; 0 for user models)."""
    runtime: int
    """Processes' own memory (trainer, shadow), or the CUDA context on a GPU."""

    @property
    def total(self) -> int:
        return self.state + self.activations + self.runtime


def _rank_numel(cfg: JobConfig, model) -> int:
    """Elements of the largest rank's flat state."""
    from unbroken.model import FlatLayout

    if not cfg.parallel.planned or cfg.model.factory:
        return FlatLayout.of(model).numel
    from unbroken.engine.build import plan_from_config
    from unbroken.engine.stage import StageModel
    from unbroken.engine.tp import TPGroup
    from unbroken.model import resolve_args
    from unbroken.model.meta import skip_meta_init

    plan, args = plan_from_config(cfg), resolve_args(cfg.model)
    best = 0
    for s in range(plan.pp):
        ranges = [g.layers for k, g in enumerate(plan.replicas[0].stages) if k % plan.pp == s]
        tp = plan.replicas[0].stages[s].tp
        with skip_meta_init():
            stage = StageModel(args, ranges, TPGroup(tp, 0), device="meta")
        best = max(best, FlatLayout.of(stage, tied=args.tied).numel)
    return best


def _activation_bytes(cfg: JobConfig) -> int:
    """Saved activations of one rank: per layer and token ~ (10·dim + 3·ffn) fp32 values plus
    the fp32 attention scores and probabilities (heads × T²), times the micro-batches in
    flight (1, or up to pp under a pipeline schedule), for the layers of one stage."""
    from unbroken.model import resolve_args

    if cfg.model.factory:
        return 0
    a = resolve_args(cfg.model)
    p, t = cfg.parallel, cfg.data.tokens_per_microbatch
    layers = -(-a.n_layers // p.pp)
    per_layer = 4 * (t * (10 * a.dim + 3 * a.ffn_dim) + 2 * a.n_heads * t * t) // p.tp
    return per_layer * layers * min(cfg.data.microbatches, p.pp)


def estimate_memory(cfg: JobConfig, model, cuda: bool) -> MemoryEstimate | None:
    """What one rank of the job needs, or None when the model is unknown here."""
    from unbroken.engine.replica import state_geometry
    from unbroken.update.layout import RetainedLayout

    if model is None:
        return None
    geometry = state_geometry(cfg, max(_rank_numel(cfg, model), 1), cuda)
    inplace = cfg.recovery.mode == "inplace"
    if inplace:
        state = sum(r.nbytes for r in RetainedLayout.of(geometry, cfg.protection).regions())
    else:
        state = 4 * 4 * geometry.padded_numel
    shadows = 1 if inplace and cfg.recovery.shadow_level > 0 else 0
    runtime = CUDA_CONTEXT_BYTES * (1 + shadows) if cuda else PROCESS_BYTES * (1 + shadows)
    return MemoryEstimate(state, _activation_bytes(cfg), runtime)


def _available_bytes(cuda: bool) -> tuple[int, str]:
    """Bytes one rank may use, and what they are."""
    if cuda:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return total, "GPU memory per device"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "memory available on this machine"
    except (OSError, KeyError, ValueError):
        return 0, ""


def _check_memory(cfg: JobConfig, model, cuda: bool, strict: bool, source: str) -> list[str]:
    est = estimate_memory(cfg, model, cuda)
    available, what = _available_bytes(cuda)
    if est is None or not available:
        return []
    ranks = 1 if cuda else cfg.parallel.world_size  # GPU: one rank per device
    need = est.total * ranks
    if need <= available:
        return []
    gib = 1 << 30
    problem = (
        f"the job needs about {need / gib:.1f} GiB ({ranks} rank(s) × {est.total / gib:.2f} "
        f"GiB: state {est.state / gib:.2f}, activations {est.activations / gib:.2f}, runtime "
        f"{est.runtime / gib:.2f}) and the {what} is {available / gib:.1f} GiB"
    )
    fix = "use a smaller model (model.preset), fewer ranks or shorter micro-batches"
    if strict:
        raise _fail(source, "memory", problem, fix + " (--strict refuses this)")
    return [f"{source}: memory: {problem}; it may not fit ({fix})"]


# -- faults and outputs ------------------------------------------------------------------------
def _check_faults(cfg: JobConfig, source: str) -> list[str]:
    from unbroken.inject import parse_fault

    warnings = []
    for spec in cfg.inject:
        fault = parse_fault(spec)
        if fault.iteration is not None and fault.iteration >= cfg.train.iterations:
            warnings.append(
                f"{source}: fault {spec!r} is scheduled at iteration {fault.iteration} and the "
                f"job runs {cfg.train.iterations} (train.iterations); it will not fire"
            )
    return warnings


def check_output(out: Path, what: str = "--out") -> None:
    """Create `out` and write a file in it once.

    Raises:
        UserError: it cannot be created or written (a path under a file, a read-only place).
    """
    for parent in (out, *out.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UserError(
                    f"{what} {out}: {parent} is a file, not a directory; choose another {what}"
                )
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UserError(
            f"{what} {out}: cannot write there ({exc.strerror or exc}); choose a writable "
            f"directory for {what}"
        ) from None


def check_job(
    cfg: JobConfig,
    out: str | Path,
    search: list[str],
    *,
    cuda: bool,
    source: str = "the job config",
    strict: bool = False,
) -> list[str]:
    """Refuse a job that cannot run, before any process starts (see the module docstring).

    Args:
        cfg: the job, device defaults resolved.
        out: its output directory (created here).
        search: directories for user modules.
        cuda: whether its trainers compute on a GPU.
        source: the config's file, for messages.
        strict: refuse a memory estimate over the device instead of warning.

    Returns:
        Warnings, each already printed to stderr as one line.

    Raises:
        UserError: one line naming the key, the file and the fix.
    """
    # cheap checks first; building the meta model imports torch's compiler stack (~1.5 s)
    _check_devices(cfg, cuda, source)
    if cfg.parallel.planned:
        _check_plan(cfg, source, search)
    warnings = _check_faults(cfg, source)
    check_output(Path(out))
    if cfg.checkpoint.dir:
        check_output(Path(cfg.checkpoint.dir), "checkpoint.dir")
    model = _meta_model(cfg, search)
    _check_no_decay(cfg, model, source)
    warnings += _check_memory(cfg, model, cuda, strict, source)
    for line in warnings:
        print(f"unbroken: warning: {line}", file=sys.stderr)
    return warnings
