"""Typed configuration of a training job: one dataclass per TOML section.

The string under each field is its user documentation: `--help` and the README's config
reference are generated from it (see `titanlab.config.docs`). Option names follow
torchtitan's TOML names wherever the concept is the same.

Each section's `validate()` raises `ConfigError` with one line naming the bad value and
what would be valid; `JobConfig.validate()` adds the checks that span sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming it and the valid choices."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class Job:
    config_file: str = ""
    """TOML file the job was read from (set by `--job.config_file`, or the launcher's first argument)."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, TensorBoard logs, exported weights."""

    description: str = "titanlab training job"
    """Free-text description, logged at start."""

    def validate(self) -> None:
        _require(bool(self.dump_folder), "job.dump_folder must not be empty")


@dataclass
class Model:
    name: str = "llama3"
    """Model family. Only `llama3` (Llama 3 / 3.1 / 3.2 architecture) exists today."""

    flavor: str = "debugmodel"
    """Model size: debugmodel, debugmodel_deep (8 thin layers, for pipeline tests), 1B, 3B, 8B,
    70B or 405B (published Llama 3 dims)."""

    tokenizer_path: str = ""
    """Llama 3 `tokenizer.model` file (tiktoken format). Empty: the bundled 4k BPE trained on the
    Python standard library. Point it at Meta's file to train with the real 128k vocabulary."""

    def validate(self) -> None:
        from titanlab.models.llama3 import llama3_flavors

        _require(self.name == "llama3", f"model.name={self.name!r} is unknown; valid: 'llama3'")
        if self.flavor not in llama3_flavors:
            raise ConfigError(
                f"model.flavor={self.flavor!r} is unknown; valid: {', '.join(llama3_flavors)}"
            )


@dataclass
class Training:
    steps: int = 1000
    """Number of optimizer steps to train for."""

    seq_len: int = 2048
    """Tokens per sample (the model also sees this many positions of RoPE)."""

    local_batch_size: int = 8
    """Samples per data-parallel rank per forward/backward (a microbatch of the optimizer step)."""

    global_batch_size: int = -1
    """Samples per optimizer step over all ranks. -1: local_batch_size × data-parallel degree.
    A multiple of that product turns on gradient accumulation."""

    max_norm: float = 1.0
    """Clip gradients to this global L2 norm (over all shards). 0 disables clipping."""

    mixed_precision_param: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Dtype of parameters during forward/backward under FSDP (master weights stay float32).
    Applied only on CUDA; CPU runs compute in float32 unless `training.mixed_precision_on_cpu`."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce under FSDP."""

    mixed_precision_on_cpu: bool = False
    """Also apply `mixed_precision_param` on CPU (slow on most CPUs; for testing)."""

    loss_scale_init: float = 65536.0
    """Initial dynamic loss scale for float16 compute (halved on overflow, that step skipped)."""

    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC is disabled). 0: never."""

    memory_check: bool = True
    """Before training, estimate the per-rank memory need and stop with one line if it cannot fit."""

    def validate(self) -> None:
        _require(self.steps >= 1, f"training.steps={self.steps} must be >= 1")
        _require(self.seq_len >= 2, f"training.seq_len={self.seq_len} must be >= 2")
        _require(self.local_batch_size >= 1,
                 f"training.local_batch_size={self.local_batch_size} must be >= 1")
        _require(self.global_batch_size == -1 or self.global_batch_size >= 1,
                 f"training.global_batch_size={self.global_batch_size} must be -1 or >= 1")
        _require(self.max_norm >= 0, f"training.max_norm={self.max_norm} must be >= 0")
        _require(self.gc_freq >= 0, f"training.gc_freq={self.gc_freq} must be >= 0")
        _require(self.loss_scale_init > 0, f"training.loss_scale_init={self.loss_scale_init} must be > 0")


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer. AdamW with decoupled weight decay (Loshchilov & Hutter, 2019)."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""

    beta1: float = 0.9
    """AdamW β1."""

    beta2: float = 0.95
    """AdamW β2."""

    eps: float = 1e-8
    """AdamW ε."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel choice for the update; `fused` falls back to `foreach` where the device lacks it."""

    def validate(self) -> None:
        _require(self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        _require(0 <= self.beta1 < 1, f"optimizer.beta1={self.beta1} must be in [0, 1)")
        _require(0 <= self.beta2 < 1, f"optimizer.beta2={self.beta2} must be in [0, 1)")
        _require(self.eps > 0, f"optimizer.eps={self.eps} must be > 0")
        _require(self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0")


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from ~0 to `optimizer.lr`."""

    decay_ratio: float = -1.0
    """Fraction of the steps after warmup spent decaying. -1: decay over all of them. A value in
    (0, 1) gives warmup-stable-decay (WSD, Hu et al. 2024, MiniCPM): constant lr, then decay."""

    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay from `optimizer.lr` to `min_lr_factor × lr`."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of `optimizer.lr`."""

    def validate(self) -> None:
        _require(self.warmup_steps >= 0, f"lr_scheduler.warmup_steps={self.warmup_steps} must be >= 0")
        _require(self.decay_ratio == -1.0 or 0.0 <= self.decay_ratio <= 1.0,
                 f"lr_scheduler.decay_ratio={self.decay_ratio} must be -1 or in [0, 1]")
        _require(0.0 <= self.min_lr_factor <= 1.0,
                 f"lr_scheduler.min_lr_factor={self.min_lr_factor} must be in [0, 1]")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """dp_replicate: number of model replicas (HSDP's replicate dimension; DDP-like all-reduce)."""

    data_parallel_shard_degree: int = -1
    """dp_shard: FSDP2 sharding degree. -1: whatever the other degrees leave of the world size."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (saves memory, costs an all-gather in backward).
    default: reshard every block except the root."""

    tensor_parallel_degree: int = 1
    """tp: tensor parallel degree (Megatron-style, always with sequence parallel for the norms)."""

    disable_loss_parallel: bool = False
    """Under tp, gather the full-vocab logits before the loss instead of computing the
    cross-entropy on vocab-sharded logits (loss parallel)."""

    pipeline_parallel_degree: int = 1
    """pp: pipeline parallel degree (number of pipeline ranks)."""

    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
        "DualPipeV",
    ] = "1F1B"
    """Pipeline schedule, used when pipeline_parallel_degree > 1."""

    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline microbatch; local_batch_size / this = microbatches per step."""

    pipeline_parallel_stages_per_rank: int = 2
    """Stages each rank holds for the looped schedules (Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble). GPipe/1F1B use 1, ZBVZeroBubble/DualPipeV 2."""

    pipeline_parallel_layers_per_stage: int = -1
    """Blocks per pipeline stage (the first and last stage hold one fewer, for the embedding and
    the output). -1: split evenly, counting embedding and output as one block each."""

    pipeline_parallel_module_fqns_per_stage: list[str] = field(default_factory=list)
    """Manual split: one entry per stage, the module names separated by spaces, e.g.
    "tok_embeddings layers.0 layers.1". Overrides the automatic split."""

    context_parallel_degree: int = 1
    """cp: context parallel degree: each sample's sequence is split over cp ranks (ring
    attention through SDPA; CUDA only)."""

    def validate(self) -> None:
        _require(self.data_parallel_replicate_degree >= 1,
                 f"parallelism.data_parallel_replicate_degree={self.data_parallel_replicate_degree}"
                 " must be >= 1")
        _require(self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
                 f"parallelism.data_parallel_shard_degree={self.data_parallel_shard_degree}"
                 " must be -1 or >= 1")
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_stages_per_rank"):
            value = getattr(self, key)
            _require(value >= 1, f"parallelism.{key}={value} must be >= 1")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints and resume from the newest complete one at start."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder (or absolute). Steps go to `<folder>/step-N`."""

    interval: int = 500
    """Save every this many steps (and always at the last step)."""

    keep_latest_k: int = 10
    """Keep only the newest k complete checkpoints (0: keep all). The seed checkpoint (step-0) is kept."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """`async`: write in a background thread while training continues (dcp.async_save)."""

    load_step: int = -1
    """Resume from this step instead of the newest complete checkpoint (-1: newest)."""

    initial_load_path: str = ""
    """A checkpoint folder (e.g. a seed checkpoint's `step-0`, or one converted from Hugging
    Face) to start from when `folder` holds no checkpoint yet. Ignored once the run has its own."""

    initial_load_model_only: bool = True
    """Load only the model weights from `initial_load_path` (fresh optimizer, step 0)."""

    create_seed_checkpoint: bool = False
    """Initialize the model on one process, save it as step-0 and exit, so every parallel layout
    can start from identical weights. Run with a single process."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the final model-only export written at the end of training (`<folder>/export`)."""

    export_at_end: bool = True
    """At the last step, also write the model weights alone (no optimizer) in `export_dtype`."""

    last_save_in_hf: bool = False
    """With `export_at_end`, also write the final export as a Hugging Face Llama folder
    (`<folder>/hf-step-N`: safetensors in `export_dtype`, config.json, and the tokenizer files
    when the model uses the bundled tokenizer), converted on rank 0 by the same code as
    `tools/convert_checkpoint.py to-hf`. Loads with `transformers` and vLLM."""

    def validate(self) -> None:
        _require(self.interval >= 1, f"checkpoint.interval={self.interval} must be >= 1")
        _require(self.keep_latest_k >= 0, f"checkpoint.keep_latest_k={self.keep_latest_k} must be >= 0")
        _require(self.load_step >= -1, f"checkpoint.load_step={self.load_step} must be -1 or >= 0")
        _require(bool(self.folder), "checkpoint.folder must not be empty")
        _require(not self.last_save_in_hf or self.export_at_end,
                 "checkpoint.last_save_in_hf=true needs checkpoint.export_at_end=true "
                 "(the Hugging Face folder is converted from the export)")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """none: keep all activations; full: recompute each block in backward; selective: see
    `selective_ac_option`."""

    selective_ac_option: str = "op"
    """For mode=selective: `op` (save matmul and attention outputs, recompute the cheap ops) or an
    integer N (checkpoint every N-th block fully)."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        _require(opt == "op" or (opt.isdecimal() and int(opt) >= 1),
                 f"activation_checkpoint.selective_ac_option={opt!r} must be 'op' or a positive integer")


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: any of model, loss."""

    backend: str = "inductor"
    """torch.compile backend."""

    def validate(self) -> None:
        bad = [c for c in self.components if c not in ("model", "loss")]
        _require(not bad, f"compile.components has {bad}; valid: model, loss")


@dataclass
class Float8:
    enable: bool = False
    """Train the Linear layers in float8 through torchao (needs `pip install 'titanlab[float8]'`
    and an NVIDIA GPU with compute capability >= 8.9, or `emulate`)."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 recipe: one dynamic scale per tensor, per row, or per row with the weight
    gradient kept in high precision."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these stay in high precision (Linears with dims
    not divisible by 16 are always skipped)."""

    emulate: bool = False
    """Run the float8 numerics with ordinary matmuls (for CPU tests; no speed-up)."""

    enable_fsdp_float8_all_gather: bool = True
    """With FSDP and the tensorwise recipe, all-gather weights in float8 (half the bytes of bf16)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With float8 all-gather: compute all weight scales in one all-reduce after each optimizer step."""

    def validate(self) -> None:
        _require(all(self.filter_fqns), f"float8.filter_fqns={self.filter_fqns} has an empty name")


@dataclass
class Metrics:
    log_freq: int = 10
    """Log a `step: N  loss: X ...` line on rank 0 every this many steps (and at the first and last)."""

    enable_tensorboard: bool = False
    """Also write the metrics to TensorBoard under `<dump_folder>/<save_tb_folder>`."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    peak_flops: float = 0.0
    """Peak dense FLOP/s of one device for MFU. 0: look the accelerator up in the built-in table
    (CPU: MFU printed as n/a)."""

    def validate(self) -> None:
        _require(self.log_freq >= 1, f"metrics.log_freq={self.log_freq} must be >= 1")
        _require(self.peak_flops >= 0, f"metrics.peak_flops={self.peak_flops} must be >= 0")


@dataclass
class Data:
    dataset_path: str = ""
    """Folder of token shards made by `tools/prepare_data.py` (with metadata.json). Empty: the
    Python standard library's .py files, prepared into the cache on first use."""

    cache_dir: str = ""
    """Where the default corpus is prepared. Empty: $TITANLAB_CACHE or ~/.cache/titanlab."""

    val_fraction: float = 0.005
    """Fraction of the token windows held out for validation (taken from the end of the data)."""

    num_workers: int = 0
    """Data loader worker processes per rank (0: load in the training process)."""

    def validate(self) -> None:
        _require(0.0 <= self.val_fraction < 1.0, f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        _require(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on the held-out split every `freq` steps."""

    freq: int = 100
    """Validation interval in steps."""

    steps: int = 10
    """Batches per validation."""

    def validate(self) -> None:
        _require(self.freq >= 1, f"validation.freq={self.freq} must be >= 1")
        _require(self.steps >= 1, f"validation.steps={self.steps} must be >= 1")


@dataclass
class Debug:
    seed: int = 0
    """Seed of model init, data order and dropout-free RNG state."""

    deterministic: bool = False
    """Use deterministic algorithms (torch.use_deterministic_algorithms); slower on GPU."""

    def validate(self) -> None:
        _require(self.seed >= 0, f"debug.seed={self.seed} must be >= 0")


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout for process-group creation and the first collectives."""

    train_timeout_seconds: int = 100
    """Timeout of any collective once training runs; a hung rank fails the job after this."""

    def validate(self) -> None:
        _require(self.init_timeout_seconds >= 1,
                 f"comm.init_timeout_seconds={self.init_timeout_seconds} must be >= 1")
        _require(self.train_timeout_seconds >= 1,
                 f"comm.train_timeout_seconds={self.train_timeout_seconds} must be >= 1")


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)

    def validate(self) -> None:
        """Validate every section, then the cross-section rules. Raises ConfigError."""
        for f in fields(self):
            getattr(self, f.name).validate()
        _require(not (self.validation.enable and self.data.val_fraction == 0),
                 "validation.enable=true needs data.val_fraction > 0 (no held-out data otherwise)")
