"""The Python entry point: run a job (reference model or your own) under unbroken.

    import unbroken
    summary = unbroken.run_job("examples/own_model/config.toml", "runs/mine", reference=True)

    from my_model import build, ArithmeticDataset
    summary = unbroken.run_job(
        "examples/own_model/config.toml",
        model_factory=functools.partial(build, hidden=256),
        dataset=ArithmeticDataset,
        optimizer={"name": "adamw", "lr": 3e-3, "betas": (0.9, 0.95)},
        metrics_port=9400,
    )
    print(summary.bit_exact, summary.recoveries[0].total_s)

`run_job` starts a coordinator, one agent and one trainer process per rank, runs the job through
injected or real failures with the configured recovery, and writes `events.jsonl`,
`metrics.jsonl`, `summary.json` and `plot.png` under `out`. With `reference=True` it first runs
the same config without faults and without checkpoints, and the summary compares the two
(`bit_exact`, `ettr`). A user model and dataset are named by import path in the config
(`model.factory`, `data.dataset`) or given as Python objects, which reach the trainer
processes by reference ([Note: user objects travel by reference] in `unbroken.config.objects`); see
docs/own-model.md. With `metrics.port` set (`metrics_port=`), Prometheus metrics and a live
status page are served while the job runs (`unbroken.metrics.live`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig, NodesConfig, load_config, to_dict
from unbroken.config.objects import factory_reference, in_job_process, pickle_dataset, reference
from unbroken.config.optimizer import apply_optimizer
from unbroken.errors import JobFailed, UserError
from unbroken.inject import faults_not_fired, parse_fault
from unbroken.launch.coordinator import Coordinator, RunOutcome
from unbroken.launch.coordinator.replay import ReplayPoint, replay_points
from unbroken.launch.rendezvous import NodeJoin
from unbroken.metrics.observer import RunObserver
from unbroken.metrics.plot import plot_runs
from unbroken.metrics.run_summary import RunSummary
from unbroken.metrics.summary import build_summary
from unbroken.preflight import check_job

__all__ = ["RunSummary", "run_job"]


def _outcome_dict(o: RunOutcome) -> dict[str, Any]:
    return {
        "metrics": o.metrics,
        "events": o.events,
        "final_state_hash": o.final_state_hash,
        "rank_hashes": o.rank_hashes,
        "state": o.state,
        "reason": o.reason,
        "run_name": o.run_name,
    }


# Long: a 34-line docstring for its 15 parameters and a 17-line signature; the body is 19 lines.
def run_job(
    config: JobConfig | str | Path | None = None,
    out: str | Path = "runs/job",
    *,
    model_factory: Callable[..., Any] | str | None = None,
    dataset: Any = None,
    optimizer: Any = None,
    reference: bool = False,
    search_path: list[str] | None = None,
    quiet: bool = False,
    fresh: bool = True,
    debug: bool = False,
    metrics_port: int | None = None,
    observers: Sequence[RunObserver] = (),
    source: str | None = None,
    strict: bool = False,
    join: NodeJoin | None = None,
    secret: str | None = None,
) -> RunSummary:
    """Run a job (and optionally its fault-free reference); returns its summary.

    Args:
        config: a `JobConfig`, the path of a TOML config, or None for the defaults.
        out: output directory (emptied first when `fresh`).
        model_factory: the model, overriding `model.factory`: a top-level function or class
            returning a `torch.nn.Module` (called with `model.factory_args`), or
            `functools.partial` of one with keyword arguments; or a "module:name" string.
        dataset: the data, overriding `data.dataset`: a class or top-level function called
            as `(data_cfg, n_shards)`, an object with `iteration(iteration, shard)` (pickled
            to every trainer), or a "module:name" string.
        optimizer: the update rule and its settings, overriding the config's
            (`unbroken.config.optimizer`): "adamw" / "sgd" / "lion" / "muon", a dict with
            "name", or `torch.optim.AdamW` / `SGD` / `Muon` or a `functools.partial` of one.
        reference: also run the fault-free reference and compare.
        search_path: extra dirs for user modules (default: the config file's dir).
        quiet: no terminal progress.
        debug: a failed rank's traceback (always in its log) also on the terminal.
        metrics_port: serve Prometheus metrics and the live status page on this port (0: any
            free port), overriding `metrics.port`; the address is in `out/live.json`.
        observers: your own live observers of each run (`unbroken.metrics.RunObserver`),
            called in this process as the job's logs grow.
        source: where the config came from, for messages (default: `config` if a path).
        strict: refuse, instead of warning about, a memory estimate over the device.
        join: node 0's place in a multi-node job (`unbroken.launch.rendezvous.resolve_join`):
            the coordinator listens on its endpoint and waits for `join.nnodes - 1` other
            nodes' agents (docs/multinode.md). The fault-free reference runs on this node alone.
        secret: the job secret the nodes share (multi-node jobs; `load_secret`).

    Raises:
        UserError: bad config, bad fault spec, missing data, an object that cannot reach the
            trainer processes, an optimizer the resumable updater does not run.
        JobFailed: the fault-free reference run failed (its reason says why).
    """
    if in_job_process():
        raise UserError(
            "run_job was called inside a process of a running job: the trainers import the "
            "script that defines your model or dataset, so put the run_job call under "
            '`if __name__ == "__main__":`'
        )
    search = list(search_path or [])
    out = Path(out)
    src = source or (str(config) if isinstance(config, str | Path) else "the job")
    cfg = _prepare(
        config,
        out,
        search,
        fresh,
        (model_factory, dataset, optimizer),
        metrics_port,
        Preflight(source=src, strict=strict),
    )
    nodes = _nodes(cfg, join, secret)
    live = _live_server(cfg, out, quiet)
    try:
        return _run(cfg, out, reference, search, quiet, debug, live, list(observers), nodes)
    finally:
        if live is not None:
            live.close()


@dataclass(frozen=True, slots=True)
class Preflight:
    """How the pre-launch checks report (`unbroken.preflight.check_job`)."""

    source: str
    """Where the config came from, named in every message."""
    strict: bool = False


def _prepare(
    config: JobConfig | str | Path | None,
    out: Path,
    search: list[str],
    fresh: bool,
    objects: tuple[Any, Any, Any],
    metrics_port: int | None,
    preflight: Preflight,
) -> JobConfig:
    """The job's config with the caller's objects (model factory, dataset, optimizer) and
    settings in it, checked before anything is written — the output directory included —,
    then written to `out/config.json` (`out` emptied first when `fresh`); `search` gains the
    dirs the trainers import the objects from."""
    model_factory, dataset, optimizer = objects
    cfg = _load(config, search)
    cfg = dataclasses.replace(cfg, train=apply_optimizer(cfg.train, optimizer))
    if metrics_port is not None:
        try:
            cfg = dataclasses.replace(
                cfg, metrics=dataclasses.replace(cfg.metrics, port=metrics_port)
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
    checked: set[str] = set()
    if model_factory is not None:
        cfg = _with_model_factory(cfg, model_factory, search, checked)
    cfg = resolve_device_defaults(cfg)
    _check_job(cfg)
    check_job(
        cfg, out, search, cuda=_on_cuda(cfg), source=preflight.source, strict=preflight.strict
    )
    if fresh:
        _clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    if dataset is not None:
        cfg = _with_dataset(cfg, dataset, out, search, checked)
    cfg = resolve_device_defaults(cfg)
    _check_job(cfg)
    _check_user_objects(cfg, search, checked)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    return cfg


def _load(config: JobConfig | str | Path | None, search: list[str]) -> JobConfig:
    if config is None:
        return JobConfig()
    if isinstance(config, JobConfig):
        return config
    path = Path(config)
    search.append(str(path.resolve().parent))
    return load_config(JobConfig, path)


def _with_model_factory(
    cfg: JobConfig, factory: Any, search: list[str], checked: set[str]
) -> JobConfig:
    if isinstance(factory, str):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, factory=factory))
    ref, kwargs = factory_reference(factory)
    try:
        json.dumps(kwargs)
    except TypeError as exc:
        raise UserError(
            f"model_factory=partial(...): its keyword arguments must be JSON values ({exc}); "
            "they are written into config.json as model.factory_args"
        ) from None
    if ref.search_dir:
        search.append(ref.search_dir)
    checked.add("model.factory")
    args = {**cfg.model.factory_args, **kwargs}
    model = dataclasses.replace(cfg.model, factory=ref.path, factory_args=args)
    return dataclasses.replace(cfg, model=model)


def _with_dataset(
    cfg: JobConfig, dataset: Any, out: Path, search: list[str], checked: set[str]
) -> JobConfig:
    if isinstance(dataset, str):
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=dataset))
    if isinstance(dataset, type | types.FunctionType):  # by reference
        ref = reference(dataset, "dataset")
        search += [ref.search_dir] if ref.search_dir else []
    else:
        if not hasattr(dataset, "iteration") and not callable(dataset):
            raise UserError(
                f"dataset={type(dataset).__name__}(...): a dataset object needs a method "
                "iteration(iteration, shard) -> list of micro-batches (docs/own-model.md)"
            )
        ref, folders = pickle_dataset(dataset, out / "objects")
        search += folders
    checked.add("data.dataset")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=ref.path))


def _live_server(cfg: JobConfig, out: Path, quiet: bool):
    """The job's metrics server and status page when `metrics.port` is set (else None)."""
    if cfg.metrics.port is None:
        return None
    from unbroken.metrics.live import LiveServer

    try:
        live = LiveServer(cfg.metrics.host, cfg.metrics.port)
    except OSError as exc:
        raise UserError(
            f"metrics.port {cfg.metrics.port}: cannot listen on {cfg.metrics.host} ({exc}); "
            "choose another port, or 0 for any free one"
        ) from None
    (out / "live.json").write_text(
        json.dumps({"url": live.url, "metrics": live.url + "metrics"}) + "\n"
    )
    if not quiet:
        print(f"unbroken: live status {live.url}  metrics {live.url}metrics", file=sys.stderr)
    return live


def _run(
    cfg: JobConfig,
    out: Path,
    reference: bool,
    search: list[str],
    quiet: bool,
    debug: bool,
    live: Any,
    observers: list[RunObserver],
    nodes: dict[str, Any],
) -> RunSummary:
    def coordinator(run_cfg: JobConfig, name: str, start=None) -> dict[str, Any]:
        watch = ([live.observe(name)] if live is not None else []) + observers
        where = nodes if run_cfg.nodes.count > 1 else {}
        c = Coordinator(
            run_cfg,
            out,
            name,
            search_path=search,
            quiet=quiet,
            debug=debug,
            observers=watch,
            start=start,
            **where,
        )
        try:
            return _outcome_dict(c.run())
        except OSError as exc:  # the rendezvous port is taken, or the host is not this one
            raise UserError(f"cannot listen on {where.get('endpoints')}: {exc}") from None

    runs: dict[str, dict[str, Any]] = {}
    ref = None
    if reference:
        ref = runs["reference"] = coordinator(reference_config(cfg), "reference")
        if ref["state"] != "done":
            raise JobFailed(f"the fault-free reference run failed: {ref['reason']}")
    name = "faulty" if reference else "train"
    main = runs[name] = coordinator(cfg, name)
    replays = _replays(cfg, main, coordinator, quiet) if ref is not None else []
    summary = build_summary(
        ref,
        main,
        to_dict(cfg),
        not_fired=faults_not_fired(cfg.inject, main["events"]),
        replays=replays,
    )
    summary["run_dir"] = str(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        plot_runs(runs, out / "plot.png")
    except ImportError as exc:  # a machine without matplotlib still gets every other output
        print(f"unbroken: no plot ({exc})", file=sys.stderr)
    return RunSummary.from_dict(summary)


def _replays(
    cfg: JobConfig, main: dict[str, Any], coordinator: Callable[..., dict[str, Any]], quiet: bool
) -> list[tuple[ReplayPoint, dict[str, Any]]]:
    """The fault-free reference run again from each plan change of `main` that changed the
    job's bits, under its plan ([Note: replayed plan change] in
    `unbroken.launch.coordinator.adapt_plan`).

    Raises:
        JobFailed: a replay failed.
    """
    replays = []
    for k, point in enumerate(replay_points(main["events"]), 1):
        if not quiet:
            print(
                f"unbroken: the re-plan at iteration {point.iteration} changed the job's bits: "
                "the fault-free reference replays it from the same checkpoint"
            )
        got = coordinator(replay_config(cfg, point), f"replay{k}", start=point)
        if got["state"] != "done":
            raise JobFailed(
                f"the fault-free reference's replay from iteration {point.iteration} failed: "
                f"{got['reason']}"
            )
        replays.append((point, got))
    return replays


def _nodes(cfg: JobConfig, join: NodeJoin | None, secret: str | None) -> dict[str, Any]:
    """The coordinator's arguments for a multi-node job (empty for one node).

    Raises:
        UserError: nodes.count and the join disagree, or no secret.
    """
    if join is None:
        if cfg.nodes.count > 1:
            raise UserError(
                f"nodes.count = {cfg.nodes.count}: start node 0 with --nnodes, --node-rank 0 "
                "and --rdzv-endpoint HOST:PORT (docs/multinode.md)"
            )
        return {}
    if join.nnodes != cfg.nodes.count:
        raise UserError(
            f"{join.source}: {join.nnodes} nodes, the config has nodes.count = {cfg.nodes.count}"
        )
    if join.spares != cfg.nodes.spares:
        raise UserError(
            f"{join.source}: {join.spares} spare node(s), the config has nodes.spares = "
            f"{cfg.nodes.spares} (--nnodes {join.nnodes}:{join.nnodes + join.spares} sets both)"
        )
    if not secret:
        raise UserError(
            "a multi-node job needs a job secret shared by its nodes: --secret-file F (mode "
            "0600) or UNBROKEN_JOB_SECRET (docs/security.md)"
        )
    from unbroken.launch.coordinator.nodes import Endpoints

    return {"endpoints": Endpoints(host=join.host, control_port=join.port), "secret": secret}


def reference_config(cfg: JobConfig) -> JobConfig:
    """The fault-free reference of `cfg`: no fault-tolerance mechanisms (Leto §8.1) — no
    checkpoints, no retained state or parity, no shadows, no faults, no re-planning. Its update
    uses the same chunk geometry, and its gradient reduction the same order (a job that
    re-plans reduces in micro-batch order, [Note: ordered reduction] in `unbroken.train.ordered`),
    so its states are comparable bit for bit ([Note: chunk-geometry])."""
    return dataclasses.replace(
        cfg,
        inject=[],
        adapt=dataclasses.replace(cfg.adapt, enabled=False),
        parallel=dataclasses.replace(
            cfg.parallel, reduce="ordered" if cfg.ordered_reduction else "allreduce"
        ),
        checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
        recovery=dataclasses.replace(cfg.recovery, mode="ckpt_restart", shadow_level=0),
        nodes=NodesConfig(),  # on the launching node alone: the same ranks, the same sums
    )


def replay_config(cfg: JobConfig, point: ReplayPoint) -> JobConfig:
    """The fault-free reference of `cfg` replaying a plan change that changed the job's bits
    ([Note: replayed plan change] in `unbroken.launch.coordinator.adapt_plan`): the
    reference's config, its first generation loading the checkpoint the faulty run kept for
    it (`point`; it saves none: `checkpoint.interval` = the job's length puts no save inside
    the run), or from the initial state when none existed."""
    ref = reference_config(cfg)
    if point.checkpoint_dir is None:
        return ref
    return dataclasses.replace(
        ref,
        checkpoint=dataclasses.replace(
            cfg.checkpoint,
            enabled=True,
            dir=point.checkpoint_dir,
            interval=cfg.train.iterations,
            asynchronous=False,
        ),
    )


def _check_job(cfg: JobConfig) -> None:
    """What the CLI process can check about a job before any process starts.

    Raises:
        UserError: one line naming what to fix.
    """
    if cfg.parallel.planned:
        if cfg.model.factory and cfg.parallel.tp > 1:
            raise UserError(
                "parallel.tp > 1 runs the reference model only (model.factory set); own models "
                "train with parallel.pp when their factory provides stages (docs/own-model.md)"
            )
        if cfg.data.dataset:
            raise UserError("parallel.tp/pp > 1 train on data.corpus (data.dataset set)")
        if cfg.model.moe_experts:
            raise UserError("parallel.tp/pp > 1: the engine runs the dense model (moe_experts set)")
    if cfg.recovery.memory_budget_mb:
        from unbroken.shadow.memory import BudgetUnavailable, require_budget_support

        try:
            require_budget_support()
        except BudgetUnavailable as exc:
            raise UserError(f"recovery.memory_budget_mb is set but {exc}") from None
    _check_gpu_retained(cfg)
    for spec in cfg.inject:
        fault = parse_fault(spec)
        if fault.rank >= cfg.parallel.world_size:
            raise UserError(
                f"fault {spec!r}: rank {fault.rank} does not exist (world_size "
                f"{cfg.parallel.world_size})"
            )
        if fault.over and not _on_cuda(cfg):
            raise UserError(
                f"fault {spec!r}: over=N sizes a spike by the GPU's free memory; this job "
                "trains on the CPU (use mb=N)"
            )


def _clear_outputs(out: Path) -> None:
    """A fresh run's outputs replace the last run's in `out`."""
    if not out.exists():
        return
    for name in (
        "events.jsonl",
        "metrics.jsonl",
        "timings.jsonl",
        "summary.json",
        "plot.png",
        "live.json",
    ):
        (out / name).unlink(missing_ok=True)
    for name in ("checkpoints", "specs", "objects", "replay"):
        shutil.rmtree(out / name, ignore_errors=True)


#: The page size of retained GPU memory: the CUDA virtual-memory granularity (ARCHITECTURE.md).
GPU_PAGE_BYTES = 2 << 20


def _on_cuda(cfg: JobConfig) -> bool:
    """Whether the job's trainers will compute on a GPU (`train.device`, auto resolved here)."""
    if cfg.train.device != "auto":
        return cfg.train.device == "cuda"
    import torch

    return torch.cuda.is_available()


def resolve_device_defaults(cfg: JobConfig) -> JobConfig:
    """`cfg` with the settings whose defaults depend on the device filled in (the protection
    page and chunk sizes, `ProtectionConfig.resolved`), once, before any process of the job
    starts: every process then reads the same sizes from its spec.

    Raises:
        UserError: a chunk size set without a page size does not divide the device's page.
    """
    try:
        protection = cfg.protection.resolved(_on_cuda(cfg))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return dataclasses.replace(cfg, protection=protection)


def _check_gpu_retained(cfg: JobConfig) -> bool:
    """Whether trainers will retain state in GPU memory; if so, check the page size fits.

    Raises:
        UserError: protection.page_bytes is not a multiple of the 2 MiB GPU page.
    """
    if cfg.recovery.mode != "inplace" or not _on_cuda(cfg):
        return False
    if cfg.protection.page_bytes % GPU_PAGE_BYTES:
        raise UserError(
            f"protection.page_bytes = {cfg.protection.page_bytes}: in-place recovery on cuda "
            f"retains state in GPU memory, whose pages are {GPU_PAGE_BYTES} bytes; set "
            f"protection.page_bytes to a multiple of {GPU_PAGE_BYTES} (or recovery.mode = "
            '"ckpt_restart")'
        )
    return True


def _check_user_objects(cfg: JobConfig, search: list[str], checked: set[str]) -> None:
    """Fail in the CLI process, with one line, if a user factory or dataset can't be imported
    (those given as objects were checked already: importing the running script again here
    would run its top level a second time)."""
    from unbroken.engine.replica import import_object

    if cfg.model.factory:
        if "model.factory" not in checked:
            import_object(cfg.model.factory, "model.factory", search)
    else:
        from unbroken.model import resolve_args

        resolve_args(cfg.model)
    if cfg.data.dataset and "data.dataset" not in checked:
        import_object(cfg.data.dataset, "data.dataset", search)
    if not cfg.data.dataset and cfg.data.tokenizer != "bytes":
        from unbroken.data import corpus_for

        corpus_for(cfg.data)  # train the BPE and tokenize here, once, before any rank starts
    elif not cfg.data.dataset and cfg.data.corpus != "stdlib":
        from unbroken.data import load_corpus

        load_corpus(cfg.data.corpus, jsonl_field=cfg.data.jsonl_field, max_documents=1)
