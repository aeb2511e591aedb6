"""Pre-flight memory estimate: will this config fit on the devices it is about to run on?

Per-rank bytes, predicted from the config and world size without allocating anything:
- parameters (fp32 master weights), gradients (fp32) and optimizer state (AdamW: two fp32
  moments; Muon: one momentum buffer for the blocks' matrices, AdamW's two for the rest), each
  divided by the number of ranks that shard them (dp_shard × cp × tp × pp; what tensor
  parallel keeps whole, `meta_counts.tp_whole_params`, by dp_shard × cp × pp);
- under FSDP, the gathered parameters of the two blocks in flight (current + prefetched) in
  the compute dtype; under expert parallel a rank gathers only its num_experts / ep experts
  (the expert weights are sharded over ep × efsdp = dp_shard × cp × tp ranks, as many as the
  dense ones);
- under expert parallel, the all-to-all buffers each MoE layer keeps for backward: the token
  slots received from the ep peers and their copy regrouped by expert (tokens × top_k × dim
  each, balanced loads assumed);
- activations kept for backward by the blocks, for the chosen activation-checkpointing mode,
  measured by tracing the real model code on fake tensors (`titanlab.planning.activation_memory`) the
  way the run executes it: under torch.compile from the compiled forward graph (the
  partitioner recomputes pointwise ops instead of saving them), under autocast (mixed precision
  without FSDP) with the compute-dtype weight copies autocast keeps, with float8 Linears their
  float8 copies; under full or per-layer AC, one block's activations are recomputed at a time
  in backward; under tensor parallel they are split over tp but for the inputs its plan
  gathers over the sequence, which every tp rank keeps whole (`titanlab.planning.tp_gathered`);
- the "head": embedding output, final norm, the output projection's input, the loss's fp32
  log-softmax (a compiled loss keeps none), and in backward the gradients of the logits (two
  fp32 tensors eagerly, one in the compute dtype from a compiled loss);
- under pipeline parallel, per rank (its own stages: the first holds the embedding, the last
  the head): the activations of the microbatches its schedule keeps in flight
  (`titanlab.planning.pipeline_memory`, from torch's own schedule order; a zero-bubble
  schedule's split backward also keeps the weight ops' output gradients from its input half to
  its weight half, `titanlab.planning.split_backward`), each stage's whole
  gradients from its first backward to the step's one reduce-scatter, every parameter of its
  stages gathered (FSDP does not reshard between a pipeline's microbatches) and the stages'
  receive buffers, one per microbatch; the estimate is the rank with the largest peak;
- a fixed runtime overhead (CUDA context and allocator slack on GPU, the interpreter on CPU).

The peak comes at the start of backward, when all activations and the logits' gradients are
alive but gradients are not (they are created during backward, as activations are freed), at
the end of backward (every gradient made but the first block's, whose activations are still
alive: the peak when checkpointing or the fused loss leave little alive at the start), or at
the optimizer step (parameters, gradients and optimizer state). With gradient accumulation the
gradients also live through the later forwards. `tests/unit/planning/test_memory_measured.py` checks the
prediction against the peak measured by PyTorch's memory profiler on CPU; `make gpu-check`
against `torch.cuda.max_memory_allocated` of the 8B-shaped rows on a GPU
(docs/performance.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from titanlab.components.head_gradient import group_rows
from titanlab.config.performance import fused_loss
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.distributed.parallelize import reshard_policy
from titanlab.models.common.mtp import boundary_width
from titanlab.planning.cp_memory import cp_attention_bytes
from titanlab.planning.memory_estimate import GIB, MemoryEstimate, shrinking_option
from titanlab.planning.pipeline_memory import rank_loads

if TYPE_CHECKING:
    from titanlab.planning.cluster import Cluster


def estimate_memory(
    model_args,
    config: JobConfig,
    world_size: int,
    compute_dtype: torch.dtype,
    device_type: str | None = None,
) -> MemoryEstimate:
    """Estimate per-rank memory for training `model_args` with `config` on `world_size` ranks.

    Args:
        model_args: a registered family's args (`titanlab.models.registry`), vocab_size set.
        compute_dtype: dtype of activations (the FSDP param dtype, float32 on CPU by default).
        device_type: "cuda" or "cpu", the devices the run is meant for (their runtime overhead
            and whether activations can be offloaded); None: this machine's.
    Returns:
        bytes per rank by category; `total` is the predicted peak including overhead.
    """
    from titanlab.planning.activation_memory import (
        depth_bytes,
        trace_activation_bytes,
        traced_modes,
    )
    from titanlab.distributed.expert_sharding import held_elements
    from titanlab.planning.meta_counts import expert_params, moe_layers, params, tp_whole_params

    model = _meta_model(model_args)
    n_params = params(model)
    p = config.parallelism
    tp, pp, cp = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree
    dp_shard = p.data_parallel_shard_degree
    if dp_shard == -1:
        dp_shard = max(world_size // (p.data_parallel_replicate_degree * tp * pp * cp), 1)
    stage = p.zero_stage_in_force
    replicas = p.data_parallel_replicate_degree
    if stage == 0:  # DDP: the dp_shard ranks replicate (ParallelDims.from_config)
        dp_shard, replicas = 1, replicas * dp_shard
    elem = torch.finfo(compute_dtype).bits // 8

    b, s = config.training.local_batch_size, config.training.seq_len
    s_local = s // cp
    layers = model_args.n_layers // pp
    # Without FSDP2 (one device, pure TP/PP) mixed precision is torch.autocast over fp32 weights.
    fsdp2_managed = dp_shard * cp > 1 or p.data_parallel_replicate_degree > 1
    autocast = compute_dtype != torch.float32 and not fsdp2_managed
    compiled = config.compile.enable
    compiled_loss = compiled and "loss" in config.compile.components and tp == 1
    # Under pipeline parallel a rank runs one microbatch at a time and keeps several in flight.
    mb = p.pipeline_parallel_microbatch_size if pp > 1 else b
    mode, option = (
        config.activation_checkpoint.mode,
        config.activation_checkpoint.selective_ac_option,
    )
    traced = trace_activation_bytes(  # remembered per arguments
        model_args,
        mb,
        s_local,
        compute_dtype,
        autocast=autocast,
        compiled_blocks=compiled and "model" in config.compile.components,
        compiled_loss=compiled_loss,
        float8=config.float8 if config.float8.enable else None,
        # The fused head keeps the same bytes whatever its chunk (the gradients of its input
        # and weight; a chunk's logits are freed before the next): traced as one chunk, it
        # costs a few fake ops rather than one pass per chunk (seconds at 8B, seq 8192).
        fused_chunk=mb * s_local if fused_loss(config) else 0,
        modes=traced_modes(mode, option),
        # blocks under no AC: every block without AC, the unchecked ones of every-Nth-block
        # selective AC, and the block in use when the others are offloaded
        compiled_none=mode == "none"
        or (mode == "selective" and option != "op")
        or config.activation_checkpoint.offload,
    )
    block = {mode: traced.block_bytes(mode, tp) for mode in traced.per_block}
    on_gpu = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    cp_mask, cp_block = cp_attention_bytes(
        config, model_args, mb, s, cp, tp, elem, "cuda" if on_gpu else "cpu"
    )
    for kept in ("none", "op"):  # what blocks that keep their activations add under CP
        if kept in block:
            block[kept] += cp_block

    ep = p.expert_parallel_degree
    moes = moe_layers(model)
    # Expert parallel's all-to-all buffers: the token slots an MoE layer receives from its ep
    # peers and their copy regrouped by expert (a microbatch's tokens × top_k × dim each,
    # balanced loads assumed), kept for backward by a block whose activations are kept (not by
    # a checkpointed one, which recomputes them); spread over the blocks as MoE blocks / blocks.
    a2a_layer = 0
    if moes and ep > 1:
        tokens = mb * s_local // tp  # an MoE layer under TP routes its rank's sequence shard
        a2a_layer = 2 * tokens * moes[0].args.top_k * model_args.dim * elem
    moe_blocks = len(moe_layers(cast(nn.Module, model.layers)))
    a2a_block = a2a_layer * moe_blocks // model_args.n_layers

    def blocks_bytes(n: int, a2a: bool = True) -> int:
        """What n blocks keep for backward per microbatch in the AC mode (with their all-to-all
        buffers unless `a2a` is false)."""
        kept = {m: b + (a2a_block if a2a and m != "full" else 0) for m, b in block.items()}
        if mode == "full":
            return n * kept["full"]
        if mode == "selective" and option == "op":
            return n * kept["op"]
        if mode == "selective":
            checkpointed = n // int(option)
            return checkpointed * kept["full"] + (n - checkpointed) * kept["none"]
        return n * kept["none"]

    acts = blocks_bytes(layers, a2a=False)
    a2a = blocks_bytes(layers) - acts
    acts += cp_mask
    # Eager: the gradients of the fp32 log-softmax and of the fp32 upcast; a compiled loss
    # writes the logits' gradient in their own dtype in one fused kernel.
    logits_grads = (
        mb * s_local * model_args.vocab_size * elem
        if compiled_loss
        else 2 * mb * s_local * model_args.vocab_size * 4
    )
    if fused_loss(config):  # one chunk's fp32 logits, turned in place into
        # their gradient (and, in a 16-bit compute dtype, the matmul's output before the upcast)
        chunk = min(config.loss.chunk_size, mb * s_local)
        logits_grads = chunk * model_args.vocab_size * (4 + (elem if elem < 4 else 0))
        head_trains = config.peft.method == "none" or "output" in config.peft.target_modules
        if head_trains:  # the rows of the logits' gradient a weight-gradient GEMM takes
            rows = group_rows(model_args.dim, chunk, compute_dtype, mb * s_local)
            logits_grads += rows * model_args.vocab_size * elem
    head = traced.head_bytes(tp) + depth_bytes(traced.depths, mode, option, layers) // tp
    logits = head + logits_grads // tp
    accumulating = config.training.global_batch_size > max(world_size // (tp * pp * cp), 1) * b
    # ZeRO-1 accumulates whole gradients over the microbatches (one reduce-scatter a step), and
    # so does FSDP under a pipeline schedule (each stage's gradients reduce-scattered once, after
    # its last microbatch's backward: `PipelineStage.perform_reduce_grad`).
    whole_grads = (stage == 1 and accumulating) or (pp > 1 and dp_shard * cp > 1)
    offloaded = config.activation_checkpoint.offload and on_gpu
    if offloaded:  # in host memory but for the block in use (on CPU: a no-op)
        acts = max(block.values())

    def gathered(module: nn.Module) -> int:
        """A module's weights gathered by FSDP: the dense ones tp-sharded but those tensor
        parallel keeps whole (`tp_whole_params`), the experts (not tensor-parallel) all of them,
        or this rank's num_experts / ep under expert parallel."""
        experts = expert_params(module)
        whole = tp_whole_params(model, module) if tp > 1 else 0
        return (params(module) - experts - whole) // tp + whole + experts // ep

    gathered_block = max(gathered(block) for block in cast(nn.ModuleDict, model.layers).values())
    resharded = reshard_policy(p.fsdp_reshard_after_forward, pp > 1, stage)
    sharded_by = dp_shard * cp * tp  # the ranks that split one pipeline stage's parameters
    # AdamW keeps two fp32 moments per parameter; Muon one momentum buffer for its matrices
    optimizer_bytes_per_param = 8.0
    if config.optimizer.name == "Muon":
        from titanlab.components.muon import takes_muon

        muon = sum(p.numel() for n, p in model.named_parameters() if takes_muon(n, p))
        optimizer_bytes_per_param = 8.0 - 4.0 * muon / n_params
    gathers = dp_shard * cp > 1 or replicas > 1

    # The expert weights are sharded on a dim that splits evenly over the efsdp ranks (without
    # expert parallel: the block's FSDP ranks); where none does, FSDP2 pads dim 0
    # (`expert_sharding.held_elements`): a rank's elements per MoE layer beyond the even share.
    padding_per_moe = 0
    if moes:
        efsdp = max(sharded_by // ep, 1)
        for w in moes[0].experts.parameters():
            local_shape = (w.shape[0] // ep, *w.shape[1:])
            padding_per_moe += held_elements(local_shape, efsdp) - w.numel() // sharded_by
    # pipeline ranks: the largest share of the MoE layers
    padding = padding_per_moe * -(-len(moes) // pp)

    tp_whole = tp_whole_params(model) if tp > 1 else 0  # a pipeline stage: its share of them

    def shard(params: int) -> float:
        """Elements of `params` (unsharded) this rank holds once FSDP and TP shard them."""
        whole = tp_whole * params / n_params
        return (params - whole) / sharded_by + whole / (dp_shard * cp)

    def grad_bytes(params: int, local: int) -> int:
        """Gradient bytes of a rank with `params` parameter elements (unsharded), `local` of
        them its own when gathered (dense ones tp-split, experts ep-split): whole gradients
        hold `local`, reduce-scattered ones their shard (with the experts' padding)."""
        return 4 * (local if whole_grads else round(shard(params)) + padding)

    def estimate(params: int, local: int, gathered_units: int, **rank) -> MemoryEstimate:
        """The estimate of a rank holding `params` parameter elements, `local` as gathered."""
        return MemoryEstimate(
            params=4 * round(shard(params)) + 4 * padding,
            grads=grad_bytes(params, local),
            optimizer=round(optimizer_bytes_per_param * shard(params))
            + round(optimizer_bytes_per_param * padding),
            gathered_params=gathered_units * elem if gathers else 0,
            overhead=(2 if on_gpu else 1) * GIB // 2,
            # a recomputed block remakes its all-to-all buffers (an MoE block's: a2a_layer)
            recompute=block["none"] + a2a_layer
            if mode == "full" or (mode == "selective" and option != "op")
            else 0,
            last_block=block["none"] + a2a_block,
            **rank,
        )

    if pp == 1:
        units = _gathered_units(model, layers * gathered_block, gathered_block, tp, pp,
                                resharded, dp_shard * cp > 1)  # fmt: skip
        return estimate(n_params, gathered(model), units, activations=acts, logits=logits,
                        a2a_buffers=a2a,
                        grads_during_forward=accumulating)  # fmt: skip
    # Each pipeline rank's own stages and microbatches in flight (their all-to-all buffers
    # counted in their activations); the rank with the largest peak.
    loads = rank_loads(
        model, config, blocks_bytes, head,
        mb * s_local * model_args.dim * boundary_width(model_args) * elem,
        logits_grads // tp, grad_bytes, gathered,
        (traced.weight_grads_per_block // tp, traced.weight_grads_head // tp),
    )  # fmt: skip
    return max(
        (
            estimate(
                load.params,
                load.gathered,
                max(2 * gathered_block, load.largest_unit) if resharded and dp_shard * cp > 1
                else load.gathered,
                activations=acts if offloaded else load.in_flight + cp_mask,
                logits=load.transient,
                grads_during_forward=accumulating or load.grads_alive,
                pipeline_buffers=load.buffers,
            )
            for load in loads
        ),
        key=lambda e: e.total,
    )  # fmt: skip


_CACHE_SIZE = 64
_META_MODELS: dict[str, nn.Module] = {}


def _meta_model(model_args) -> nn.Module:
    """The model on the meta device, built once per args (read only: parameter counts and the
    block structure); the layout planner asks for hundreds of layouts of one model."""
    from titanlab.models.registry import build_model

    key = repr(model_args)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= _CACHE_SIZE:
            _META_MODELS.clear()
        with torch.device("meta"):
            _META_MODELS[key] = build_model(model_args)
    return _META_MODELS[key]


def _gathered_units(
    model: nn.Module, blocks: int, block: int, tp: int, pp: int, resharded: bool, sharded: bool
) -> int:
    """Parameters (elements) a rank holds gathered at its peak, the start of backward, besides
    its shards (`titanlab.distributed.parallelize`'s units: each block, the embedding, the final
    norm + output together, the root). `blocks`: every block of the pipeline stage gathered,
    `block`: the largest one, both tp-sharded.

    ZeRO-3 (FSDP2, blocks resharded after forward): the norm + output unit, never resharded
    after forward, or two blocks in flight (the running one and the prefetched one), whichever
    is larger. Stages 1 and 2 keep every unit gathered from forward to backward; so does
    FSDP2's `replicate` (DDP: stage 0, or dp_replicate without dp_shard), whose parameters live
    twice, as the one-rank "shard" and as the gathered copy the blocks compute with."""
    from titanlab.planning.meta_counts import params as count

    def params(*modules) -> int:
        return sum(count(m) for m in modules if m is not None) // tp

    output = getattr(model, "output", None)
    embedding = getattr(model, "tok_embeddings", None)
    tied = output is not None and embedding is not None and output.weight is embedding.weight
    tail = params(getattr(model, "norm", None), None if tied else output)
    embed = params(embedding)
    if sharded and resharded:
        return max(2 * block, embed if tied else tail)  # tied: the root keeps the shared weight
    # A pipeline stage holds the embedding (first) or the norm + output (last), not both.
    return blocks + (embed + tail if pp == 1 else max(embed, tail))


def available_bytes_per_rank(local_world_size: int) -> tuple[int, str]:
    """(bytes, description) one rank may use: the GPU's total memory, or the host's
    MemAvailable shared by the ranks on this host."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{torch.cuda.get_device_name(0)} with {total / GIB:.1f} GiB"
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    per_rank = avail // max(local_world_size, 1)
    return per_rank, (
        f"{avail / GIB:.1f} GiB of available host memory shared by "
        f"{local_world_size} CPU process(es), {per_rank / GIB:.1f} GiB each"
    )


def check_memory(
    model_args,
    config: JobConfig,
    world_size: int,
    local_world_size: int,
    compute_dtype: torch.dtype,
    target: Cluster | None = None,
) -> MemoryEstimate:
    """Raise ConfigError (one line) when the estimate exceeds what a rank has: this machine's
    GPU or host memory, or with `target` (a dry run's `comm.dry_run_device`) one device of that
    cluster profile.

    Skipped (returns the estimate only) when `training.memory_check` is false.
    """
    device_type = target.device_type if target is not None else None
    est = estimate_memory(model_args, config, world_size, compute_dtype, device_type)
    if not config.training.memory_check:
        return est
    gpu_check = ""
    if target is not None:
        have = int(target.memory_bytes)
        what = f"{have / GIB:.1f} GiB on each {target.name} (comm.dry_run_device)"
    else:
        have, what = available_bytes_per_rank(local_world_size)
        if not torch.cuda.is_available():  # a GPU config checked on a CPU machine
            gpu_check = (
                "; this checked this machine's host memory: check a GPU run against a GPU "
                "profile with a dry run, `titanlab train CONFIG --comm.mode fake_backend "
                "--comm.dry_run_device h100` (h100, h200, a100, b200)"
            )
    if est.total > have:
        raise ConfigError(
            f"model.flavor={config.model.flavor} needs about {est.total / GIB:.1f} GiB per rank "
            f"({est.summary()}) on {world_size} rank(s), but there is {what}; "
            f"{shrinking_option(est, config)}; else a smaller model.flavor (e.g. debugmodel) "
            f"(--training.memory_check false skips this check){gpu_check}"
        )
    return est


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
