"""Sections that trade compute for memory or speed: `[activation_checkpoint]`, `[compile]`,
`[float8]`, `[loss]`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from titanlab.config.errors import ConfigError, _require


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """none: keep all activations; full: recompute each block in backward; selective: see
    `selective_ac_option`."""

    selective_ac_option: str = "op"
    """For mode=selective: `op` (save matmul and attention outputs, recompute the cheap ops) or an
    integer N (checkpoint every N-th block fully)."""

    offload: bool = False
    """Move what each block saves for backward to pinned host memory as it is saved (a side CUDA
    stream), and back when backward needs it (torchtune's activation offloading, through
    `saved_tensors_hooks`); composes with any mode (a checkpointed block saves only its input).
    Needs a CUDA GPU (refused before launch on CPU, where activations already live in host
    memory). Not with compile."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        _require(
            opt == "op" or (opt.isdecimal() and int(opt) >= 1),
            f"activation_checkpoint.selective_ac_option={opt!r} must be 'op' or a positive integer",
        )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: any of model (each transformer block) and loss (the cross-entropy; it
    stays eager under tensor parallel's loss parallel)."""

    backend: str = "inductor"
    """torch.compile backend."""

    def validate(self) -> None:
        bad = [c for c in self.components if c not in ("model", "loss")]
        _require(not bad, f"compile.components has {bad}; valid: model, loss")


@dataclass
class Kernels:
    liger: bool = False
    """Liger Kernel's Triton kernels on a CUDA GPU (`pip install 'titanlab[liger]'`; Hsu et al.
    2024, arXiv:2410.10989): RMSNorm and the SwiGLU product swapped into the model's modules
    (same parameters and names, so checkpoints are unchanged), and with
    `loss.fused_linear_cross_entropy` Liger's fused linear cross-entropy in the head. RoPE
    stays titanlab's: Liger's kernel rotates the halves of each head (Hugging Face's layout),
    titanlab the interleaved pairs. Refused without the package, without CUDA, and under
    tensor parallel (the norms see sequence-sharded DTensors)."""

    def validate(self) -> None:
        pass  # the package and the device are checked before launch (`check_liger`)


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

    grouped_experts: bool = False
    """With `enable`: the routed experts' grouped GEMMs in float8 too, scaled per row
    (torchao's float8 rowwise grouped GEMM, `torchao.prototype.moe_training`), each expert's
    token group padded to a multiple of 16 rows as its kernel needs. SwiGLU experts
    (qwen3_moe, deepseek_v3, qwen3_5's MoE); a GPU with float8 only: torchao's kernels are
    Triton's and have no emulate mode (docs/moe.md)."""

    enable_fsdp_float8_all_gather: bool = True
    """With FSDP and the tensorwise recipe, all-gather weights in float8 (half the bytes of bf16)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With float8 all-gather: compute all weight scales in one all-reduce after each optimizer step."""

    def validate(self) -> None:
        _require(all(self.filter_fqns), f"float8.filter_fqns={self.filter_fqns} has an empty name")
        _require(
            self.enable or not self.grouped_experts,
            "float8.grouped_experts=true needs float8.enable=true",
        )


@dataclass
class Loss:
    fused_linear_cross_entropy: bool | Literal["auto"] = "auto"
    """Compute the output head and the cross-entropy together over chunks of `chunk_size`
    tokens, so the (tokens × vocab) logits never exist whole (Liger's FusedLinearCrossEntropy;
    Wijmans et al. 2024, arXiv:2411.09009): at a 128k vocabulary the logits of one 8k-token
    sequence are 4 GiB in fp32. Same loss and gradients within fp32 rounding. One process, data
    parallel (FSDP, HSDP, DDP), tensor parallel (the head split by vocabulary, the log-sum-exp
    all-reduced over the tp ranks), context parallel (each rank's sequence shard) and pipeline
    parallel (the last stage's forward ends in the loss). RL and DPO take their
    log-probabilities from the head chunk by chunk too (tp 1), and distillation its loss (the
    teacher's head too; tp 1, pp 1). A LoRA adapter on the output head adds its low-rank
    logits chunk by chunk (plain cross-entropy, tp 1, no Liger or NF4 base). true is refused
    with RL or distillation under TP, distillation under PP, and the adapted head with what it
    does not cover; auto (the default) is true
    where none of those applies and a microbatch holds more than `chunk_size` tokens (then
    the whole logits never exist), false elsewhere (`fused_loss`)."""

    chunk_size: int = 1024
    """Tokens per chunk of the fused loss (1 .. local_batch_size × seq_len); the largest
    transient is one chunk's logits (chunk_size × vocab; fp32 where the chunk runs eagerly):
    512 MiB at a 128k vocabulary in fp32. Each chunk's two GEMMs read the head's whole weight,
    so a chunk below a GPU's FLOP/byte ridge (~300 tokens on an H100) is memory-bound: in the
    per-op ledger (docs/ledger.md; Llama 3 8B's head, 8192 tokens, H100) 256 priced the trainer
    5.6% above the plain loop, 1024 1.0%."""

    def validate(self) -> None:
        _require(self.chunk_size >= 1, f"loss.chunk_size={self.chunk_size} must be >= 1")


def validate_kernels(config: Any) -> None:
    """Liger's refusals that need no machine (`config` a JobConfig); the package and CUDA are
    checked before launch (`titanlab.components.liger.check_liger`)."""
    tp = config.parallelism.tensor_parallel_degree
    _require(
        not config.kernels.liger or tp == 1,
        f"kernels.liger=true with parallelism.tensor_parallel_degree={tp} is not supported "
        "(Liger's RMSNorm takes plain tensors, not sequence-sharded DTensors); use tp 1 or "
        "kernels.liger=false",
    )


def validate_offload(config: Any) -> None:
    """Activation offloading's refusals (`config` a JobConfig): one line each."""
    _require(
        not (config.activation_checkpoint.offload and config.compile.enable),
        "activation_checkpoint.offload=true with compile.enable=true is not supported (the "
        "saved-tensor hooks stay outside compiled graphs); turn one off",
    )


def compiles_loss(config: Any) -> bool:
    """Whether the loss runs under torch.compile (`config` a JobConfig): compile on with "loss"
    among `compile.components`; the plain loss function then, or the fused loss's chunks."""
    return bool(config.compile.enable and "loss" in config.compile.components)


def fused_loss(config: Any) -> bool:
    """Whether the run computes the fused linear cross-entropy (`config` a JobConfig): the
    option when true or false; for auto, true when a microbatch (local_batch_size × seq_len
    tokens) holds more than `loss.chunk_size` tokens and nothing the fused loss refuses is set.
    Depends on the config alone, so every rank, the pre-flight and the memory estimator agree."""
    option = config.loss.fused_linear_cross_entropy
    if option != "auto":
        return bool(option)
    tokens = config.training.local_batch_size * config.training.seq_len
    if tokens <= config.loss.chunk_size:
        return False
    try:
        _check_fused_loss_combinations(config)
    except ConfigError:
        return False
    return True


def loss_description(config: Any, vocab_size: int) -> str:
    """The start-up line's words for the loss: fused (chunk, and that auto chose it) or plain,
    with the fp32 logits of a microbatch that the fused loss never holds whole."""
    tokens = config.training.local_batch_size * config.training.seq_len
    logits = f"{tokens * vocab_size * 4 / 2**20:.0f} MiB"
    chose = " (auto)" if config.loss.fused_linear_cross_entropy == "auto" else ""
    if fused_loss(config):
        chunk = config.loss.chunk_size
        return (
            f"fused linear cross-entropy{chose}, chunks of {chunk} tokens (the {logits} of fp32 "
            f"logits of a microbatch never held whole; {chunk * vocab_size * 4 / 2**20:.0f} MiB "
            "at a time)"
        )
    return f"cross-entropy on the whole logits{chose} ({logits} in fp32 per microbatch)"


def validate_loss_combinations(config: Any) -> None:
    """What `loss.fused_linear_cross_entropy=true` composes with in this version (`config` a
    JobConfig): one line per refusal, naming both options (auto falls back to the plain loss
    instead, `fused_loss`)."""
    if config.loss.fused_linear_cross_entropy is True:
        _check_fused_loss_combinations(config)


def _check_fused_loss_combinations(config: Any) -> None:
    loss, par = config.loss, config.parallelism
    tokens = config.training.local_batch_size * config.training.seq_len
    _require(
        loss.chunk_size <= tokens,
        f"loss.chunk_size={loss.chunk_size} is larger than a microbatch "
        f"(training.local_batch_size × seq_len = {tokens} tokens); use 1 .. {tokens}",
    )
    _require(
        not config.distill.teacher_path or par.pipeline_parallel_degree == 1,
        f"loss.fused_linear_cross_entropy=true with distill.teacher_path and "
        f"parallelism.pipeline_parallel_degree={par.pipeline_parallel_degree} is not supported "
        "(the pipeline's distillation loss takes the last stage's logits); use pp 1 or the "
        "plain loss",
    )
    _require(
        config.rl.algorithm == "none" or par.tensor_parallel_degree == 1,
        f"loss.fused_linear_cross_entropy=true with rl.algorithm={config.rl.algorithm} and "
        f"parallelism.tensor_parallel_degree={par.tensor_parallel_degree} is not supported "
        "(the fused log-probabilities are not split by vocabulary yet); use tp 1 or the plain "
        "loss",
    )
    _require(
        not config.distill.teacher_path or par.tensor_parallel_degree == 1,
        f"loss.fused_linear_cross_entropy=true with distill.teacher_path and "
        f"parallelism.tensor_parallel_degree={par.tensor_parallel_degree} is not supported "
        "(the fused distillation loss is not split by vocabulary yet); use tp 1 or the plain "
        "loss",
    )
    _require(
        par.tensor_parallel_mode == "1d" or par.tensor_parallel_degree == 1,
        f"loss.fused_linear_cross_entropy=true with parallelism.tensor_parallel_mode="
        f"{par.tensor_parallel_mode} is not supported yet (the grid's head gathers its logits "
        "by rows); use the plain loss or tensor_parallel_mode=1d",
    )
    peft = config.peft
    if peft.method == "none" or "output" not in peft.target_modules:
        return
    # LoRA on the output head: the fused cross-entropy adds the adapter's low-rank logits
    # chunk by chunk (`lora_linear_cross_entropy_sum`); its other paths do not yet.
    others = {
        f"parallelism.tensor_parallel_degree={par.tensor_parallel_degree}": (
            par.tensor_parallel_degree > 1
        ),
        "distill.teacher_path": bool(config.distill.teacher_path),
        f"rl.algorithm={config.rl.algorithm}": config.rl.algorithm != "none",
        "kernels.liger=true": bool(config.kernels.liger),
        "peft.quantize_base=nf4": peft.quantize_base == "nf4",
    }
    for name, on in others.items():
        _require(
            not on,
            f"loss.fused_linear_cross_entropy=true with peft.target_modules containing 'output' "
            f"and {name} is not supported (the adapted head's fused loss covers plain "
            "cross-entropy without tensor parallel); drop one of them or use the plain loss",
        )
