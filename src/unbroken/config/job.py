"""The job config: one small typed config per component, nested in `JobConfig`.

Every field has a docstring; every config checks its invariants in `__post_init__` and raises
`ValueError` with the key to fix (the loader adds the file name and turns it into a `UserError`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from unbroken.config.nodes import NodesConfig
from unbroken.config.vocab import resolve_vocabulary

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProtectionConfig",
    "RecoveryConfig",
    "TrainConfig",
]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"
    """Reference model size: tiny (CI), small (demo), 125m, 350m, 1b. Fields below override it."""
    dim: int | None = None
    """Hidden size."""
    n_layers: int | None = None
    """Number of decoder layers."""
    n_heads: int | None = None
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide n_heads."""
    ffn_dim: int | None = None
    """SwiGLU hidden size (per expert for MoE)."""
    vocab_size: int | None = None
    """Vocabulary size; must cover the tokenizer's ids. Unset: the tokenizer's (256 for bytes,
    `data.vocab_size` for a BPE, a tokenizer file's size rounded up to a multiple of 64); see
    `unbroken.config.vocab`."""
    moe_experts: int | None = None
    """Routed experts per layer; 0 = dense model."""
    moe_top_k: int | None = None
    """Experts each token is routed to."""
    tie_embeddings: bool = False
    """Share one weight between the token embedding and the output head (GPT-2 style weight
    tying; reference model only). On a pipeline the first and last stages each hold a copy
    whose gradients are summed across the stages, as Megatron does."""
    factory: str | None = None
    """Import path `module:function` of a user model factory (see docs/own-model.md)."""
    factory_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the user factory."""

    def __post_init__(self) -> None:
        if self.factory is not None and ":" not in self.factory:
            raise ValueError(
                f"model.factory must look like 'module:function', got {self.factory!r}"
            )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    corpus: str = "stdlib"
    """'stdlib' (the running Python's own .py sources), a folder of text files, or a .jsonl file."""
    jsonl_field: str = "text"
    """Field holding the document text in each JSONL line."""
    tokens_per_microbatch: int = 512
    """Token budget N of one packed micro-batch."""
    microbatches: int = 4
    """Micro-batches per data-parallel replica per iteration."""
    seed: int = 1234
    """Seed of the document order; the sampler is a pure function of it."""
    max_documents: int = 0
    """Use only the first K documents of the corpus (0 = all)."""
    dataset: str | None = None
    """Import path `module:Class` of a user dataset (see docs/own-model.md)."""
    tokenizer: str = "auto"
    """'bytes' (UTF-8 bytes, 256 ids), 'bpe' (a byte-level BPE trained once on this corpus with
    Hugging Face `tokenizers`, cached by corpus hash), the path of a Hugging Face
    `tokenizer.json`, or 'auto': bpe for the 125m, 350m and 1b presets, bytes otherwise
    (`unbroken.config.vocab`). The corpus is tokenized once, before the ranks start."""
    vocab_size: int = 0
    """Token ids of the BPE that data.tokenizer = 'bpe' trains (0: model.vocab_size, else the
    preset's, else 32768)."""

    def __post_init__(self) -> None:
        if not self.tokenizer.strip():
            raise ValueError(
                "data.tokenizer must be 'auto', 'bytes', 'bpe' or a tokenizer.json path"
            )
        if self.vocab_size < 0:
            raise ValueError("data.vocab_size must be >= 0 (0 = the model's vocabulary)")
        if self.tokens_per_microbatch < 8:
            raise ValueError("data.tokens_per_microbatch must be at least 8")
        if self.microbatches < 1:
            raise ValueError("data.microbatches must be at least 1")
        if self.max_documents < 0:
            raise ValueError("data.max_documents must be >= 0")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    iterations: int = 100
    """Iterations (optimizer steps) in the run."""
    lr: float = 2.2e-4
    """Peak learning rate (Leto A.1)."""
    warmup_frac: float = 0.1
    """Fraction of iterations of linear warm-up."""
    min_lr_frac: float = 0.1
    """Cosine decays to this fraction of the peak."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to trainable matrices; never to vectors (norm weights,
    biases) nor to parameters matched by `no_decay`."""
    no_decay: list[str] = field(default_factory=list)
    """Parameters exempt from weight decay, as `fnmatch` patterns over parameter names
    (case-sensitive; a tied parameter is exempt when any of its names matches), e.g.
    ["embed.*", "head.weight"] for "no decay for embeddings" on the reference model. Each
    pattern must match a parameter of the model (checked before launch)."""
    grad_clip: float = 1.0
    """Clip gradients to this global norm (0 disables)."""
    optimizer: Literal["adamw", "sgd", "lion", "muon"] = "adamw"
    """The update rule of the resumable updater (docs/optimizers.md): adamw (beta1, beta2,
    eps); sgd with momentum (momentum, dampening, nesterov; weight decay is torch's coupled L2);
    lion (lion_beta1, lion_beta2); muon (Newton–Schulz orthogonalized momentum per 2-D weight
    matrix: muon_*; every other parameter, and matrices matched by `muon_adamw`, take AdamW
    with beta1, beta2, eps). `lr` and `weight_decay` serve every rule."""
    momentum: float = 0.9
    """SGD momentum factor (0 = plain SGD)."""
    dampening: float = 0.0
    """SGD dampening of the momentum buffer."""
    nesterov: bool = False
    """SGD Nesterov momentum (needs momentum > 0 and dampening = 0, as in torch)."""
    lion_beta1: float = 0.9
    """Lion: interpolation weight of the update direction."""
    lion_beta2: float = 0.99
    """Lion: decay of the momentum."""
    muon_momentum: float = 0.95
    """Muon momentum factor."""
    muon_nesterov: bool = True
    """Muon Nesterov momentum."""
    muon_ns_steps: int = 5
    """Muon Newton–Schulz iterations per matrix."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon learning-rate scaling per matrix shape [A, B]: match_rms_adamw = 0.2·sqrt(max(A, B))
    (Moonlight; one `lr` serves the Muon matrices and the AdamW rest), original = sqrt(max(1,
    A/B)) (Keller Jordan's; tune `lr` for Muon then)."""
    muon_adamw: list[str] = field(default_factory=lambda: ["*embed*", "*head*", "*wte*", "*wpe*"])
    """2-D parameters updated by AdamW instead of Muon (embeddings and the output head, the
    usual Muon recipe), as `fnmatch` patterns over parameter names."""
    init_std: float = 0.006
    """Weights are initialized from N(0, init_std^2)."""
    seed: int = 0
    """Seed of parameter initialization and of the random numbers a model draws
    (`unbroken.train.rng`)."""
    hash_every: int = 1
    """Iterations between state hashes in metrics.jsonl (1: every one, which lets a run with
    failures be compared with its reference iteration by iteration; 0: none but the final
    state's). The hash is sha256 of the whole state (parameters and both moments) on rank 0,
    inside the iteration, and every rank waits for it at the next all-reduce: about 0.8 s per
    GiB of state on one core (a 125m model: 0.9 GiB)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where trainers compute; auto = cuda when available."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """fp32 on CPU; bf16 autocast with fp32 master weights on GPU (auto picks these)."""
    threads: int = 1
    """torch intra-op threads per trainer process."""

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError("train.iterations must be at least 1")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError("train.warmup_frac must be in [0, 1)")
        if self.lr <= 0:
            raise ValueError("train.lr must be positive")
        if self.threads < 1:
            raise ValueError("train.threads must be at least 1")
        if self.hash_every < 0:
            raise ValueError("train.hash_every must be >= 0 (0 = only the final state)")
        if self.weight_decay < 0:
            raise ValueError("train.weight_decay must be >= 0")
        if self.grad_clip < 0:
            raise ValueError("train.grad_clip must be >= 0 (0 disables clipping)")
        self._check_optimizer()
        for i, pattern in enumerate(self.no_decay):
            if not pattern.strip():
                raise ValueError(f"train.no_decay[{i}] is empty; give a parameter-name pattern")

    def _check_optimizer(self) -> None:
        """Hyper-parameters of the chosen optimizer (one line per bad value)."""
        if self.optimizer not in ("adamw", "sgd", "lion", "muon"):
            raise ValueError(
                f"train.optimizer={self.optimizer!r}: use one of 'adamw', 'sgd', 'lion', 'muon'"
            )
        unit = {
            "adamw": ("beta1", "beta2"),
            "sgd": ("dampening",),
            "lion": ("lion_beta1", "lion_beta2"),
            "muon": ("beta1", "beta2", "muon_momentum"),
        }[self.optimizer]
        for name in unit:
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.optimizer == "sgd":
            if self.momentum < 0:
                raise ValueError(f"train.momentum must be >= 0, got {self.momentum}")
            if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
                raise ValueError("train.nesterov needs train.momentum > 0 and train.dampening = 0")
        if self.optimizer in ("adamw", "muon") and self.eps <= 0:
            raise ValueError(f"train.eps must be positive, got {self.eps}")
        if self.muon_adjust_lr not in ("match_rms_adamw", "original"):
            raise ValueError(
                f"train.muon_adjust_lr={self.muon_adjust_lr!r}: use 'match_rms_adamw' or 'original'"
            )
        if self.optimizer == "muon" and not 1 <= self.muon_ns_steps < 100:
            raise ValueError(f"train.muon_ns_steps must be in [1, 100), got {self.muon_ns_steps}")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    world_size: int = 4
    """Trainer ranks (one process each)."""
    dp: int = 0
    """Data-parallel degree (0 = world_size / (tp * pp))."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Communicator backend; auto = nccl on cuda, else gloo."""
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb_h1"] = "1f1b"
    """Pipeline schedule when pp > 1 (`unbroken.parallel.schedules`)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B needs >= 2)."""
    reduce: Literal["auto", "allreduce", "ordered"] = "auto"
    """Data-parallel gradient reduction: allreduce = one all-reduce per bucket (its summation
    order follows the world size and the placement); ordered = every micro-batch's gradient
    alone, summed in micro-batch order (`unbroken.train.ordered`): the same bits for any
    placement and world size, at the cost of a gradient copy per local micro-batch and an
    all-to-all. auto = ordered when `adapt.enabled`, else allreduce."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError("parallel.world_size must be at least 1")
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be at least 1")
        model_ranks = self.tp * self.pp
        if self.world_size % model_ranks:
            raise ValueError(
                f"parallel degrees don't divide the world: tp*pp = {model_ranks} does not divide "
                f"world_size = {self.world_size}; change parallel.tp, parallel.pp or world_size"
            )
        if self.dp == 0:
            self.dp = self.world_size // model_ranks
        if self.dp * model_ranks != self.world_size:
            raise ValueError(
                f"parallel degrees don't divide the world: dp*tp*pp = "
                f"{self.dp}*{self.tp}*{self.pp} = {self.dp * model_ranks} != world_size = "
                f"{self.world_size}; set parallel.dp = {self.world_size // model_ranks} or leave it 0"
            )
        if self.tp & (self.tp - 1):
            raise ValueError(f"parallel.tp must be a power of two (got {self.tp})")
        if self.virtual_stages < 1:
            raise ValueError("parallel.virtual_stages must be at least 1")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise ValueError(
                "parallel.schedule = 'interleaved' goes with parallel.virtual_stages >= 2, and "
                f"only it (got {self.schedule!r} with virtual_stages = {self.virtual_stages})"
            )

    @property
    def planned(self) -> bool:
        """True when the job runs through the hybrid-parallel engine (tp or pp > 1)."""
        return self.tp > 1 or self.pp > 1


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    enabled: bool = True
    """Take periodic checkpoints (torch.distributed.checkpoint)."""
    interval: int = 0
    """Iterations between checkpoints; 0 = Young's formula from mttf_s and the measured cost."""
    mttf_s: float = 600.0
    """Mean time to (fatal) failure used by Young's formula, seconds."""
    keep: int = 3
    """Complete checkpoints kept on disk (older ones are deleted)."""
    dir: str = ""
    """Checkpoint directory (default: OUT/checkpoints)."""
    asynchronous: bool = False
    """Save in the background (`save_checkpoint_async`): the loop blocks only while the state
    is copied into host buffers reserved at the generation's start (pinned for a GPU state),
    a thread writes, digests and seals the checkpoint, and the next save, a load or the end of
    the generation waits for it. A crash before the seal leaves an incomplete checkpoint that
    every reader skips (the previous one is used). Off by default, on GPUs too: on for a 1b job
    on an H200 (bench/results/gpu-h200.md, stop 43) it cut the loop's blocked time per save
    from 14-17 s to 0.2 s but slowed both L3 recoveries (1.1 / 1.4 s -> 3.4 / 7.5 s): the
    killed trainer, holding 11.7 GB of pinned staging, took about 2 s to exit, and the
    promoted trainer pinned its own at its first save, inside the recovery."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError("checkpoint.interval must be >= 0 (0 = Young's formula)")
        if self.mttf_s <= 0:
            raise ValueError("checkpoint.mttf_s must be positive")
        if self.keep < 2:
            raise ValueError(
                "checkpoint.keep must be at least 2 so a corrupt newest one has a fallback"
            )


#: Device defaults of (page_bytes, chunk_bytes, stripe_pages). GPU: the 2 MiB CUDA
#: virtual-memory page that retained GPU memory needs, whole-page chunks and stripes of 64
#: pages per segment (D = 192). With the model's parity in host memory what stays in HBM is the
#: gradient parity (shrinking as D grows), the undo buffer of one chunk (growing with it) and
#: the staging: on the H200 at 1b, stripes of 64 took 22.6 ms an update and 4.8 % of the
#: retained state's HBM, stripes of 32 23.0 ms and 5.5 % (bench/results/gpu-h200.md, stop 38).
#: Whole-page chunks: 512 KiB chunks and stripes of 8 took 76.6 ms against 26.8 ms (stop 28,
#: the parity math is the same per byte, smaller chunks pay more transactions). CPU: small
#: pages suit the small CPU models. The CPU geometry on a GPU cut a 125m state into 1,160
#: update chunks, 0.23 s of kernel launches per iteration on the H200.
PROTECTION_DEFAULTS = {"cpu": (64 << 10, 32 << 10, 8), "cuda": (2 << 20, 2 << 20, 64)}


@dataclass(kw_only=True, slots=True)
class ProtectionConfig:
    page_bytes: int | None = None
    """Page size S of retained state (unset: 2 MiB when the job trains on a GPU, 64 KiB on
    the CPU; see `resolved`)."""
    stripe_pages: int | None = None
    """Pages of each state segment per protection group; a group has D = 3 x stripe_pages
    data pages (parameters, exp_avg, exp_avg_sq). Unset: 64 when the job trains on a GPU, 8
    on the CPU (see `resolved`)."""
    parity_pages: int | None = None
    """First-tier parity pages H1 per group: tolerates H1 lost pages per group. Unset: 3 when
    the job trains on a GPU (the Vandermonde code, see `code`), 4 on the CPU."""
    code: Literal["auto", "cauchy", "vandermonde"] = "auto"
    """The first tier's generator matrix (`unbroken.erasure.gf256`): ``cauchy`` (any H1; ISA-L's
    ``gf_gen_cauchy1_matrix``) or ``vandermonde`` (H1 <= 3 only, where it is MDS; ISA-L's
    ``gf_gen_rs_matrix``: the P, Q, R syndromes), whose parity delta the GPU's fused update
    computes by Horner's rule with multiplications by 2 — about half the instructions of the
    Cauchy code's table arithmetic, which bounds that kernel (bench/results/gpu-h200.md, stop
    40). auto: vandermonde on a GPU when H1 <= 3, else cauchy. The CPU codecs run either at
    the same speed."""
    second_tier_pages: int = 1
    """Second-tier parity pages H2 over each group's first tier."""
    chunk_bytes: int | None = None
    """Bytes per page of one update transaction (must divide page_bytes; unset: the whole
    2 MiB page on a GPU, 32 KiB on the CPU, at most page_bytes)."""
    parity_memory: Literal["host", "device"] = "host"
    """Where the model's parity (both tiers) lives when the job trains on a GPU: pinned host
    memory owned by the state manager (Leto §4: persistent parity takes no HBM; the updater
    stages each chunk's new parity range in HBM and writes it back over PCIe beside the next
    chunk's work), or HBM beside the state. The CPU keeps everything in host memory."""
    lend_activations: bool = True
    """On a GPU, the protection buffers that matter only from the gradients' protection to the
    end of the update (gradient parity, undo, scratch) hold the compute phase's activations in
    between (Leto §5.2: a memory pool lent back and forth; `unbroken.update.lending`), so they
    cost no HBM of their own beyond what the activations leave unused. The CPU ignores it."""

    def __post_init__(self) -> None:
        if self.page_bytes is not None and (self.page_bytes <= 0 or self.page_bytes % 4096):
            raise ValueError("protection.page_bytes must be a positive multiple of 4096")
        if self.chunk_bytes is not None and (self.chunk_bytes <= 0 or self.chunk_bytes % 64):
            raise ValueError("protection.chunk_bytes must be a positive multiple of 64")
        if (
            self.page_bytes is not None
            and self.chunk_bytes is not None
            and self.page_bytes % self.chunk_bytes
        ):
            raise ValueError(
                "protection.chunk_bytes must be a multiple of 64 that divides page_bytes"
            )
        stripe = 1 if self.stripe_pages is None else self.stripe_pages
        h1 = 1 if self.parity_pages is None else self.parity_pages
        if stripe < 1 or h1 < 1 or self.second_tier_pages < 1:
            raise ValueError("protection: stripe_pages, parity_pages, second_tier_pages >= 1")
        if 3 * stripe + h1 > 256:
            raise ValueError("protection: 3 * stripe_pages + parity_pages must be <= 256")
        if self.code == "vandermonde" and h1 > 3:
            raise ValueError(
                "protection.code = 'vandermonde' is MDS for parity_pages <= 3 only; use "
                "'cauchy' for more"
            )

    def _code(self, cuda: bool) -> tuple[str, int]:
        """The first tier's generator and H1: unset H1 is 3 for the Vandermonde code (the GPU's
        default, auto) and 4 for the Cauchy code (the CPU's)."""
        vandermonde = self.code == "vandermonde" or (self.code == "auto" and cuda)
        h1 = self.parity_pages or (3 if vandermonde else 4)
        if self.code == "auto":
            return ("vandermonde" if cuda and h1 <= 3 else "cauchy"), h1
        return self.code, h1

    def resolved(self, cuda: bool) -> ProtectionConfig:
        """This config with unset sizes filled for the device (`PROTECTION_DEFAULTS`); a chunk
        default that does not divide a page size the user set becomes the whole page.

        Raises:
            ValueError: a chunk size the user set does not divide the default page size.
        """
        set_ = (self.page_bytes, self.chunk_bytes, self.stripe_pages, self.parity_pages)
        if None not in set_ and self.code != "auto":
            return self
        page, chunk, stripe = PROTECTION_DEFAULTS["cuda" if cuda else "cpu"]
        code, h1 = self._code(cuda)
        if self.stripe_pages is not None:
            stripe = self.stripe_pages
        if 3 * stripe + h1 > 256:  # a default stripe with a large H1 the user set
            stripe = (256 - h1) // 3
        if self.page_bytes is not None:
            page = self.page_bytes
            chunk = chunk if chunk <= page and page % chunk == 0 else page
        if self.chunk_bytes is not None:
            chunk = self.chunk_bytes
        return dataclasses.replace(
            self,
            page_bytes=page,
            chunk_bytes=chunk,
            stripe_pages=stripe,
            parity_pages=h1,
            code=code,
        )


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    mode: Literal["inplace", "ckpt_restart"] = "inplace"
    """Recovery for hardware-operable failures: inplace = new trainers reattach to the retained,
    parity-protected state (checkpoint fallback when it is beyond repair); ckpt_restart = restart
    every rank from the newest checkpoint (the baseline)."""
    shadow_level: int = 3
    """In-place mode: pre-initialized shadow trainers per rank, at level 1 (imports), 2 (+ device
    runtime, threads, corpus) or 3 (+ communicators); 0 = none (restart processes)."""
    shadow_start: Literal["fork", "exec"] = "fork"
    """How shadows start: fork = from the node's pre-imported fork server (L1 at once, see
    unbroken.shadow.forkserver); exec = a fresh interpreter each (every import paid again)."""
    shadow_warmup: Literal["after_trainer", "at_start"] = "at_start"
    """When a GPU shadow (level 2 or 3) runs its kernel warm-up (`unbroken.shadow.warm`):
    at_start = as soon as it starts; after_trainer = once the trainer it would replace has
    completed an iteration (the agent's `WarmUp`), so the successor shadows of a recovery do
    not compete for the GPU with the promoted trainer's first iteration. Measured on an H200
    (bench/results/gpu-h200.md, stop 48): that first iteration +13 % instead of +22 % over
    steady, but the go waits for an iteration that may save a checkpoint, so a second failure
    soon after a takeover found no shadow ready (2.1 s instead of 1.2 s): not the default."""
    premap: bool = True
    """Shadows at level 2 or 3 map their device's retained regions once the trainer they would
    replace is training, so a promoted one finds them mapped (on a GPU: every 2 MiB page's
    import and mapping, about 0.1 ms each, paid before the failure, not in recovery)."""
    memory_budget_mb: int = 0
    """Memory the job may use on a node (trainers, shadows, state managers), MiB; 0 = no
    budget. Enforced by the kernel through a cgroup-v1 memory controller (Linux, root):
    see docs/architecture.md, "Memory budget and reclamation"."""
    memory_reclaim: bool = True
    """Under a budget: an allocation that would exceed it waits while the node's shadows are
    reclaimed (Leto §6) instead of the kernel OOM killer striking."""
    max_restarts: int = 20
    """Give up after this many recoveries in one run."""
    heartbeat_interval_s: float = 0.1
    """Trainer -> agent heartbeat period."""
    heartbeat_timeout_s: float = 2.0
    """A trainer silent for this long is declared hung (must exceed heartbeat_interval_s)."""
    collective_timeout_s: float = 60.0
    """Timeout of the trainers' process groups (must exceed heartbeat_timeout_s)."""
    node_heartbeat_s: float = 0.5
    """Agent -> coordinator beat period (the second level of heartbeats)."""
    node_timeout_s: float = 5.0
    """A node whose agent is silent this long (or whose connection drops) is lost."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s < self.collective_timeout_s:
            raise ValueError(
                "recovery timeouts must satisfy 0 < heartbeat_interval_s < heartbeat_timeout_s "
                f"< collective_timeout_s (got {self.heartbeat_interval_s}, "
                f"{self.heartbeat_timeout_s}, {self.collective_timeout_s})"
            )
        if not 0 < self.node_heartbeat_s < self.node_timeout_s:
            raise ValueError(
                "recovery: need 0 < node_heartbeat_s < node_timeout_s "
                f"(got {self.node_heartbeat_s}, {self.node_timeout_s})"
            )
        if self.max_restarts < 0:
            raise ValueError("recovery.max_restarts must be >= 0")
        if self.shadow_level not in (0, 1, 2, 3):
            raise ValueError("recovery.shadow_level must be 0, 1, 2 or 3")
        if self.memory_budget_mb < 0:
            raise ValueError("recovery.memory_budget_mb must be >= 0 (0 = no budget)")
        if self.shadow_start not in ("fork", "exec"):
            raise ValueError("recovery.shadow_start must be 'fork' or 'exec'")
        if self.shadow_warmup not in ("after_trainer", "at_start"):
            raise ValueError("recovery.shadow_warmup must be 'after_trainer' or 'at_start'")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    port: int | None = None
    """Serve Prometheus metrics (`/metrics`) and the live status page (`/`) from the
    coordinator's process on this TCP port while the job runs; unset = off, 0 = any free port
    (the address is printed and written to `live.json` in the run directory)."""
    host: str = "127.0.0.1"
    """Address the metrics server binds ("0.0.0.0" to let other machines scrape it)."""

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(
                f"metrics.port must be in 0..65535 (0 = any free port), got {self.port}"
            )
        if not self.host.strip():
            raise ValueError("metrics.host must name an address, e.g. 127.0.0.1")


ADAPT_POLICIES = ("resihp", "greyhound", "evict")
"""`adapt.policy` values."""


@dataclass(kw_only=True, slots=True)
class AdaptConfig:
    """Live reconfiguration (issue 18): the running job follows the scheduler."""

    enabled: bool = False
    """A lost device (its health check failed) or a validated fail-slow report makes the
    coordinator re-plan (`unbroken.plan`) and the job continue on the new placement: for a lost
    device on the remaining ranks without a checkpoint, for a slow one at an iteration boundary.
    Implies parallel.reduce = "ordered". A plan job (parallel.pp or tp > 1; schedule 1f1b or
    gpipe): around a lost device, with a whole replica left, the broken replicas are dissolved
    and the survivors continue on their retained state (a TP-2 group that lost one device, in
    a job retaining its state, shrinks to its peer instead when predicted `min_gain` faster,
    its stage moved to it from a whole replica); without one, a TP-1 job runs a smaller
    pipeline from the newest checkpoint (a TP job at its degree; a TP-2 job left with one device
    at TP 1 computing as TP 2; a larger degree stops with the reason); around a slow device
    (more than one replica) micro-batches move between replicas at a boundary, and with
    retained state layers move and a slow device's TP-2 group shrinks to its peer (at a
    planned stop, the state moved between the ranks)."""
    max_replans: int = 4
    """Most re-plans for slow devices a job makes, and for their return to full speed (a cap
    on a detector that fires on noise)."""
    min_gain: float = 0.1
    """A re-plan for a slow device is executed only if the planner predicts an iteration at
    least this fraction faster than the running placement."""
    policy: str = "resihp"
    """What the coordinator does with a slow or lost device. "resihp": the scheduler's plan
    (above). The baselines of ResiHP §8.1, run live by `unbroken bench adapt`: "greyhound" —
    micro-batches redistributed by measured speed (the planner without its exclusion step:
    Greyhound's `solve_dp`), and no answer to a lost device (the job fails, as without
    re-planning); "evict" — evict-and-restart (Oobleck-like): a validated slow device is
    excluded, and the job restarts from its newest checkpoint on the other devices with an
    even plan (a pipeline job: one even pipeline); a lost device the same way (retained state
    and replicas are not used). A pipeline job's "greyhound" moves micro-batches between its
    replicas, one kept on each."""
    probe_every: int = 4
    """A plan job's replica the scheduler left with no micro-batch (its devices too slow for
    even one) runs a probe micro-batch every this many iterations — discarded, no effect on
    the state or the data order — so that the detector sees when its devices run at full
    speed again and the job gives them their work back (`unbroken.engine.probe`). 0: never
    (such a device then stays out until the job restarts)."""

    readmit_after: int = 50
    """A data-parallel job that retains its state (recovery.mode = "inplace") under "resihp":
    a slow device whose own work would still bound the iteration with no micro-batch left on it
    (its optimizer step) is taken out of the world instead, in place like a lost one, when that
    is predicted `min_gain` faster; it waits as a standby and is re-admitted on trial after
    this many iterations (the detector reports it again if it is still slow; each new
    exclusion doubles the wait), while `max_replans` leaves room to exclude it again. 0: slow
    devices are never excluded (emptied and probed in the world instead)."""

    def __post_init__(self) -> None:
        if self.max_replans < 0:
            raise ValueError("adapt.max_replans must be >= 0")
        if self.readmit_after < 0:
            raise ValueError("adapt.readmit_after must be >= 0")
        if self.probe_every < 0:
            raise ValueError("adapt.probe_every must be >= 0")
        if not 0 <= self.min_gain < 1:
            raise ValueError("adapt.min_gain must be in [0, 1)")
        if self.policy not in ADAPT_POLICIES:
            raise ValueError(
                f"adapt.policy {self.policy!r} is unknown (one of {', '.join(ADAPT_POLICIES)})"
            )


@dataclass(kw_only=True, slots=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, packing and sampling."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer, schedule, device and precision."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Ranks and parallel degrees."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic checkpoints (baseline recovery and fatal-failure fallback)."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """How failures are detected and recovered."""
    protection: ProtectionConfig = field(default_factory=ProtectionConfig)
    """Pages, protection groups and update chunks of the retained state."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The live metrics endpoint and status page (off by default)."""
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    """Live reconfiguration around lost and slow devices."""
    nodes: NodesConfig = field(default_factory=NodesConfig)
    """Hosts of the job and ranks per host (one node by default)."""
    inject: list[str] = field(default_factory=list)
    """Faults to inject, e.g. "kill:rank=1,iter=12,phase=update" (see unbroken.inject)."""

    def __post_init__(self) -> None:
        # The tokenizer and the model's vocabulary are decided together, once, here; every
        # process then reads the same values from its spec.
        self.model, self.data = resolve_vocabulary(self.model, self.data)
        parallel = self.parallel
        self.nodes.per_node(parallel.world_size)  # raises when the nodes do not hold the world
        planned_ordered = parallel.reduce == "ordered" or (
            parallel.reduce == "auto" and self.adapt.enabled
        )
        if (
            parallel.planned
            and planned_ordered
            and (parallel.schedule not in ("1f1b", "gpipe") or parallel.virtual_stages != 1)
        ):
            raise ValueError(
                f'parallel.reduce = "ordered" (implied by adapt.enabled) keeps every micro-batch\'s '
                f"gradient apart, which a pipeline schedule with split backward or virtual stages "
                f'does not: set parallel.schedule = "1f1b" or "gpipe" (got '
                f'"{parallel.schedule}", virtual_stages = {parallel.virtual_stages})'
            )
        if self.adapt.enabled and parallel.reduce == "allreduce":
            raise ValueError(
                'adapt.enabled needs parallel.reduce = "ordered" (or "auto"): a re-planned run '
                "is audited bit for bit against the fault-free one"
            )

    @property
    def ordered_reduction(self) -> bool:
        """Whether data-parallel gradients are reduced in micro-batch order (`parallel.reduce`,
        "auto" deciding by `adapt.enabled`)."""
        reduce = self.parallel.reduce
        return reduce == "ordered" or (reduce == "auto" and self.adapt.enabled)
