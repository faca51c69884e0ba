"""The Python entry point: run a job (reference model or your own) under unbroken.

    from unbroken.api import run_job
    summary = run_job("examples/own_model/config.toml", out="runs/mine", reference=True)

`run_job` starts a coordinator, one agent and one trainer process per rank, runs the job through
injected or real failures with the configured recovery, and writes `events.jsonl`,
`metrics.jsonl`, `summary.json` and `plot.png` under `out`. With `reference=True` it first runs
the same config without faults and without checkpoints, and the summary compares the two
(`bit_exact`, `ettr`). A user model and dataset are named by import path in the config
(`model.factory`, `data.dataset`); see docs/own-model.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig, load_config, to_dict
from unbroken.errors import JobFailed, UserError
from unbroken.inject import faults_not_fired, parse_fault
from unbroken.launch.coordinator import Coordinator, RunOutcome
from unbroken.metrics.plot import plot_runs
from unbroken.metrics.summary import build_summary
from unbroken.preflight import check_job

__all__ = ["run_job"]


def _outcome_dict(o: RunOutcome) -> dict[str, Any]:
    return {
        "metrics": o.metrics,
        "events": o.events,
        "final_state_hash": o.final_state_hash,
        "rank_hashes": o.rank_hashes,
        "state": o.state,
        "reason": o.reason,
    }


def run_job(
    config: JobConfig | str | Path,
    out: str | Path,
    *,
    reference: bool = False,
    search_path: list[str] | None = None,
    quiet: bool = False,
    fresh: bool = True,
    debug: bool = False,
    source: str | None = None,
    strict: bool = False,
) -> dict[str, Any]:
    """Run a job (and optionally its fault-free reference); returns the summary dict.

    Args:
        config: a `JobConfig` or the path of a TOML config.
        out: output directory (emptied first when `fresh`).
        reference: also run the fault-free reference and compare.
        search_path: extra dirs for user modules (default: the config file's dir).
        quiet: no terminal progress.
        debug: a failed rank's traceback (always in its log) also on the terminal.
        source: where the config came from, for messages (default: `config` if a path).
        strict: refuse, instead of warning about, a memory estimate over the device.

    Raises:
        UserError: bad config, bad fault spec, missing data.
        JobFailed: the fault-free reference run failed (its reason says why).
    """
    cfg, search = _load(config, search_path)
    src = source or (str(config) if not isinstance(config, JobConfig) else "the job")
    check_job(cfg, out, search, cuda=_on_cuda(cfg), source=src, strict=strict)
    out = Path(out)
    if fresh:
        _clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))

    def run(run_cfg: JobConfig, name: str) -> dict[str, Any]:
        coord = Coordinator(run_cfg, out, name, search_path=search, quiet=quiet, debug=debug)
        return _outcome_dict(coord.run())

    runs: dict[str, dict[str, Any]] = {}
    ref = None
    if reference:
        ref = runs["reference"] = run(reference_config(cfg), "reference")
        if ref["state"] != "done":
            raise JobFailed(f"the fault-free reference run failed: {ref['reason']}")
    name = "faulty" if reference else "train"
    main = runs[name] = run(cfg, name)
    summary = build_summary(
        ref, main, to_dict(cfg), not_fired=faults_not_fired(cfg.inject, main["events"])
    )
    summary["run_dir"] = str(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        plot_runs(runs, out / "plot.png")
    except ImportError as exc:  # a machine without matplotlib still gets every other output
        print(f"unbroken: no plot ({exc})", file=sys.stderr)
    return summary


def _load(config: JobConfig | str | Path, search_path: list[str] | None):
    """The job's config, checked and with its device defaults resolved, and the dirs user
    modules are searched in (the config file's dir last)."""
    search = list(search_path or [])
    if not isinstance(config, JobConfig):
        path = Path(config)
        cfg = load_config(JobConfig, path)
        search.append(str(path.resolve().parent))
    else:
        cfg = config
    cfg = resolve_device_defaults(cfg)
    _check_job(cfg)
    _check_user_objects(cfg, search)
    return cfg, search


def reference_config(cfg: JobConfig) -> JobConfig:
    """The fault-free reference of `cfg`: no fault-tolerance mechanisms (Leto §8.1) — no
    checkpoints, no retained state or parity, no shadows, no faults. Its update uses the same
    chunk geometry, so its states are comparable bit for bit ([Note: chunk-geometry])."""
    return dataclasses.replace(
        cfg,
        inject=[],
        checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
        recovery=dataclasses.replace(cfg.recovery, mode="ckpt_restart", shadow_level=0),
    )


def _check_job(cfg: JobConfig) -> None:
    """What the CLI process can check about a job before any process starts.

    Raises:
        UserError: one line naming what to fix.
    """
    if cfg.parallel.planned:
        if cfg.model.factory:
            raise UserError("parallel.tp/pp > 1 run the reference model only (model.factory set)")
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
    for name in ("events.jsonl", "metrics.jsonl", "timings.jsonl", "summary.json", "plot.png"):
        (out / name).unlink(missing_ok=True)
    for name in ("checkpoints", "specs"):
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


def _check_user_objects(cfg: JobConfig, search: list[str]) -> None:
    """Fail in the CLI process, with one line, if a user factory or dataset can't be imported."""
    from unbroken.engine.replica import import_object

    if cfg.model.factory:
        import_object(cfg.model.factory, "model.factory", search)
    else:
        from unbroken.model import resolve_args

        resolve_args(cfg.model)
    if cfg.data.dataset:
        import_object(cfg.data.dataset, "data.dataset", search)
    if not cfg.data.dataset and cfg.data.tokenizer != "bytes":
        from unbroken.data import corpus_for

        corpus_for(cfg.data)  # train the BPE and tokenize here, once, before any rank starts
    elif not cfg.data.dataset and cfg.data.corpus != "stdlib":
        from unbroken.data import load_corpus

        load_corpus(cfg.data.corpus, jsonl_field=cfg.data.jsonl_field, max_documents=1)
