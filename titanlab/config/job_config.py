"""Typed configuration of a training job: one dataclass per TOML section.

The string under each field is its user documentation: `--help` and the README's config
reference are generated from it (see `titanlab.config.docs`). Option names follow
torchtitan's TOML names wherever the concept is the same.

Each section's `validate()` raises `ConfigError` with one line naming the bad value and
what would be valid; `JobConfig.validate()` adds the checks that span sections.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Literal

from titanlab.config.checkpointing import Checkpoint
from titanlab.config.data import Data, DataSource, SchedulePoint
from titanlab.config.distill import Distill
from titanlab.config.errors import ConfigError, _require
from titanlab.config.fault_tolerance import FaultTolerance, validate_fault_tolerance
from titanlab.config.metrics import Metrics
from titanlab.config.model import Model
from titanlab.config.optimizer import Optimizer
from titanlab.config.parallelism import Parallelism
from titanlab.config.peft import Peft
from titanlab.config.performance import (
    ActivationCheckpoint,
    Compile,
    Float8,
    Kernels,
    Loss,
    validate_loss_combinations,
    validate_kernels,
    validate_offload,
)
from titanlab.config.profiling import Profiling
from titanlab.config.rl import RL, validate_rl_combinations

__all__ = [
    "RL",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Data",
    "DataSource",
    "Debug",
    "Distill",
    "FaultTolerance",
    "Float8",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Peft",
    "Profiling",
    "SchedulePoint",
    "Training",
    "Validation",
]


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

    skip_nonfinite_steps: int = -1
    """N >= 0: a step whose loss or global gradient norm is NaN or infinite is not applied (no
    optimizer update; the learning-rate schedule still advances, as for a float16 overflow) and
    a warning names it; the (N+1)-th such step in a row stops the run before its update (exit 3;
    0: the first). Under float16 the loss scaler keeps handling gradient overflows and only a
    non-finite loss counts. Costs a host sync per step (the host reads the two values before the
    update), so -1, the default, does not check: a non-finite loss then stops the run at the
    next logging step, after its update (never checkpointed). 3 suits long runs, where one bad
    batch should not end the run. Not with `rl.algorithm` (its updates are its own)."""

    mixed_precision_param: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Dtype of parameters during forward/backward under FSDP (master weights stay float32).
    Applied only on CUDA; CPU runs compute in float32 unless `training.mixed_precision_on_cpu`."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce under FSDP."""

    mixed_precision_on_cpu: bool = False
    """Also apply `mixed_precision_param` on CPU (slow on most CPUs; for testing)."""

    fixed_malloc_thresholds: bool = True
    """On CPU with glibc: fix malloc's mmap and trim thresholds (32 MiB, 1 GiB) so each step
    reuses heap memory instead of faulting in fresh pages (`titanlab.trainer.host_allocator`;
    5-8% of a debug-model step, docs/performance.md)."""

    loss_scale_init: float = 65536.0
    """Initial dynamic loss scale for float16 compute (halved on overflow, that step skipped)."""

    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC is disabled). 0: never."""

    memory_check: bool = True
    """Before training, estimate the per-rank memory need and stop with one line if it cannot fit."""

    seq_len_warmup_steps: int = 0
    """Sequence-length warmup: over the first this many steps the model sees sequences of
    `seq_len_warmup_start` tokens, doubling in equal stages up to `seq_len` (each window of
    `seq_len` is cut into 2^k rows, so the tokens per step stay the same and the data order
    does not change). 0: off. Not with pipeline parallel."""

    seq_len_warmup_start: int = 256
    """First sequence length of the warmup: `seq_len` divided by a power of two."""

    def validate(self) -> None:
        _require(self.steps >= 1, f"training.steps={self.steps} must be >= 1")
        _require(
            self.seq_len_warmup_steps >= 0,
            f"training.seq_len_warmup_steps={self.seq_len_warmup_steps} must be >= 0",
        )
        if self.seq_len_warmup_steps:
            ratio = self.seq_len // max(self.seq_len_warmup_start, 1)
            _require(
                self.seq_len_warmup_start >= 1
                and self.seq_len % self.seq_len_warmup_start == 0
                and ratio & (ratio - 1) == 0,
                f"training.seq_len_warmup_start={self.seq_len_warmup_start} must be "
                f"training.seq_len={self.seq_len} divided by a power of two (e.g. "
                f"{max(self.seq_len // 8, 1)})",
            )
        _require(self.seq_len >= 2, f"training.seq_len={self.seq_len} must be >= 2")
        _require(
            self.local_batch_size >= 1,
            f"training.local_batch_size={self.local_batch_size} must be >= 1",
        )
        _require(
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            f"training.global_batch_size={self.global_batch_size} must be -1 or >= 1",
        )
        _require(self.max_norm >= 0, f"training.max_norm={self.max_norm} must be >= 0")
        _require(
            self.skip_nonfinite_steps >= -1,
            f"training.skip_nonfinite_steps={self.skip_nonfinite_steps} must be -1 (no check) "
            "or >= 0 (the non-finite steps in a row to skip before stopping)",
        )
        _require(self.gc_freq >= 0, f"training.gc_freq={self.gc_freq} must be >= 0")
        _require(
            self.loss_scale_init > 0, f"training.loss_scale_init={self.loss_scale_init} must be > 0"
        )


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
        _require(
            self.warmup_steps >= 0, f"lr_scheduler.warmup_steps={self.warmup_steps} must be >= 0"
        )
        _require(
            self.decay_ratio == -1.0 or 0.0 <= self.decay_ratio <= 1.0,
            f"lr_scheduler.decay_ratio={self.decay_ratio} must be -1 or in [0, 1]",
        )
        _require(
            0.0 <= self.min_lr_factor <= 1.0,
            f"lr_scheduler.min_lr_factor={self.min_lr_factor} must be in [0, 1]",
        )


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

    record_batches: bool = False
    """Write the token ids every step trains on to `<dump_folder>/batches/rank<N>.jsonl` (one
    line per step: step, dp_rank, the rank's input and label ids), to check that two runs saw
    the same data. For debugging: it reads every batch back to the host."""

    def validate(self) -> None:
        _require(self.seed >= 0, f"debug.seed={self.seed} must be >= 0")


COMM_MODES = ("default", "fake_backend", "local_tensor")


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout for process-group creation and the first collectives."""

    train_timeout_seconds: int = 100
    """Timeout of any collective once training runs; a hung rank fails the job after this."""

    mode: str = "default"
    """How the ranks talk. "default": real process groups (one process per rank, torchrun).
    "fake_backend": a dry run in one process at the real world size (`comm.fake_world_size`,
    else NGPU): PyTorch's fake process group, the model on the meta device, the real layout,
    optimizer, LR schedule and checkpoint save plan built; it prints each rank's parameter,
    gradient and optimizer bytes and the pre-flight's memory estimate against
    `comm.dry_run_device`, then exits without training. "local_tensor": every rank of a small
    world (2-8, `comm.fake_world_size`) simulated in one process with real numerics
    (torch.distributed._local_tensor), for debugging a layout without torchrun. run_train.sh
    starts one process for both."""

    fake_world_size: int = -1
    """World size the "fake_backend" / "local_tensor" modes simulate when NGPU is not set (NGPU
    wins); a shipped config states here the world size it is sized for. -1: NGPU only."""

    dry_run_device: str = "h100"
    """The GPU a "fake_backend" dry run checks memory against: a built-in cluster profile
    (h100, h200, a100, b200; `titanlab.planning.cluster`) or a profile JSON file; its memory
    and compute dtype are used, not this machine's."""

    dry_run_step: bool = False
    """In a "fake_backend" dry run, also run one microbatch's forward and backward through the
    trainer's own step code on fake tensors (shapes only; seconds for a debug model, about half
    a minute for an 8B at seq_len 8192); not under pipeline parallel."""

    ledger: bool = False
    """In a "fake_backend" dry run, print the per-op ledger of one whole training step priced
    for `comm.dry_run_device` instead of the dry run's report (`titanlab ledger`,
    docs/ledger.md); not under pipeline parallel."""

    def validate(self) -> None:
        close = difflib.get_close_matches(self.mode.replace("-", "_"), COMM_MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        _require(
            self.mode in COMM_MODES,
            f"comm.mode={self.mode!r} is not one of {', '.join(COMM_MODES)}{hint}",
        )
        _require(
            not self.ledger or self.mode == "fake_backend",
            f"comm.ledger=true needs comm.mode=fake_backend (comm.mode={self.mode!r}): the "
            "ledger prices a step of the simulated world on fake tensors",
        )
        _require(
            self.fake_world_size == -1 or self.fake_world_size >= 1,
            f"comm.fake_world_size={self.fake_world_size} must be >= 1 (or -1: NGPU)",
        )
        _require(
            self.init_timeout_seconds >= 1,
            f"comm.init_timeout_seconds={self.init_timeout_seconds} must be >= 1",
        )
        _require(
            self.train_timeout_seconds >= 1,
            f"comm.train_timeout_seconds={self.train_timeout_seconds} must be >= 1",
        )


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
    loss: Loss = field(default_factory=Loss)
    kernels: Kernels = field(default_factory=Kernels)
    peft: Peft = field(default_factory=Peft)
    distill: Distill = field(default_factory=Distill)
    rl: RL = field(default_factory=RL)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def validate(self) -> None:
        """Validate every section, then the cross-section rules. Raises ConfigError."""
        for f in fields(self):
            getattr(self, f.name).validate()
        _require(
            not (self.validation.enable and self.data.val_fraction == 0),
            "validation.enable=true needs data.val_fraction > 0 (no held-out data otherwise)",
        )
        _require(
            self.peft.quantize_base == "none" or bool(self.checkpoint.initial_load_path),
            f"peft.quantize_base={self.peft.quantize_base} needs checkpoint.initial_load_path "
            "(the base model whose weights are quantized)",
        )
        _require(
            self.training.skip_nonfinite_steps == -1 or self.rl.algorithm == "none",
            f"training.skip_nonfinite_steps={self.training.skip_nonfinite_steps} checks the "
            f"pretraining and fine-tuning step; rl.algorithm={self.rl.algorithm} runs its own "
            "updates (set training.skip_nonfinite_steps=-1)",
        )
        validate_loss_combinations(self)
        validate_offload(self)
        validate_kernels(self)
        if self.rl.algorithm != "none":
            validate_rl_combinations(self)
        if self.fault_tolerance.enable:
            validate_fault_tolerance(self)
