"""Tensor parallel with sequence parallel (Megatron-LM style) through `parallelize_module`.

Plan (Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for sequence parallel):
- tok_embeddings: row-wise (vocab sharded); output sharded on the sequence dim for the norms.
- each block: `titanlab.distributed.tensor_parallel.plan.decoder_block_plan` (the per-head q/k
  norms included when the model's args have them; an MoE layer runs on each rank's local tokens;
  multi-head latent attention by `titanlab.distributed.tensor_parallel.mla`): attention wq/wk/wv
  and FFN w1/w3 column-wise (heads / hidden units sharded), so attention runs on local heads;
  wo and w2 row-wise, their outputs reduce-scattered onto sequence shards; Qwen3's per-head q/k
  norms on the sharded heads dim.
- attention_norm, ffn_norm, norm: sequence parallel (each rank normalizes its own tokens), so
  activations between blocks are sharded on the sequence dim and every parameter is a DTensor
  (plain-tensor norm weights would break foreach AdamW and clip_grad_norm_).
- Blocks take and return DTensors (`use_local_output=False`), so the residual stream stays a
  DTensor from the embedding to the final norm. torch.compile needs this: a compiled block that
  returned a plain tensor hands a plain gradient to the eager redistribute before it, which
  fails in torch 2.13. Pipeline stages exchange plain tensors; the first and last block of a
  stage convert.
- output: column-wise; with loss parallel the logits stay vocab-sharded (`Shard(-1)`) and the
  cross-entropy runs under `loss_parallel()`, never materializing the full vocab on one rank.
- LoRA: an adapter is split with its base Linear (A replicated and B by rows under a
  column-wise base; A by columns and B replicated under a row-wise one), so every product stays
  local (`titanlab.distributed.tensor_parallel.lora`).
- float8 (tensorwise recipe, on GPUs): the block's Linear layers use torchao's float8 styles
  (`Float8ColwiseParallel`, `Float8RowwiseParallel`, `PrepareFloat8ModuleInput`), which cast to
  float8 before the all-gather, so TP moves half the bytes of bf16 (torchao's float8 README,
  "float8 tensor parallel"). gloo cannot carry float8 tensors, so on CPU the float8 layers are
  sharded with the ordinary styles and communicate in high precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from titanlab.distributed.tensor_parallel.mla import mla_attention_plan
from titanlab.distributed.tensor_parallel.plan import SequenceParallel, decoder_block_plan
from titanlab.models.common.linear_attention import GatedDeltaNet
from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.mla import MLAttention

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from titanlab.models.common.decoder import Decoder


def block_styles(float8_comm: bool, lora: bool = False) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) parallel styles for the transformer blocks: torchao's
    float8 ones when `float8_comm` (the Linear layers must already be torchao Float8Linear);
    ones that also split LoRA adapters when `lora`
    (`titanlab.distributed.tensor_parallel.lora`)."""
    if lora:
        from titanlab.distributed.tensor_parallel.lora import (
            LoRAColwiseParallel,
            LoRARowwiseParallel,
        )

        return LoRAColwiseParallel, LoRARowwiseParallel, PrepareModuleInput
    if float8_comm:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


class FusedHeadParallel(ColwiseParallel):
    """Column-wise (vocab rows) split of a head that returns the loss (`returns_loss`, the
    fused loss's `titanlab.components.fused_head.FusedLossHead`): in training its forward returns the
    summed loss as a plain tensor, equal on every tp rank, which passes through; logits
    (outside `fused_targets`) are laid out as ColwiseParallel lays them out."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )


def apply_tp(
    model: Decoder,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    float8_comm: bool = False,
    lora: bool = False,
) -> None:
    """Shard `model` (a Decoder or a pipeline stage of one) over `tp_mesh` in place.

    Input tokens (bs, seq) must be identical on every tp rank; the output is logits (bs, seq,
    vocab) as a DTensor sharded on vocab when `loss_parallel`, else a plain replicated tensor.
    A middle pipeline stage takes and returns (bs, seq, dim) hidden states sharded on seq.
    `float8_comm`: all-gather the blocks' activations in float8 (torchao tensorwise recipe).
    `lora`: the blocks' Linear layers may carry LoRA adapters, split with their base.
    """
    colwise, rowwise, prepare_input = block_styles(float8_comm, lora)
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "value_head", None) is not None:
        # PPO's scalar head reads the final norm's sequence shards: replicated weight, its
        # gradient summed over the tp ranks like the norms'.
        top["value_head"] = SequenceParallel()
    if model.output is not None:
        # A LoRA adapter on the head is split like one on wq (A replicated, B by vocab rows).
        head = colwise if lora else ColwiseParallel
        if getattr(model.output, "returns_loss", False):  # components.fused_head.FusedLossHead
            head = FusedHeadParallel
        top["output"] = head(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    # Between blocks (and between pipeline stages) activations are plain local (bs, seq/tp, dim)
    # tensors; the sequence-parallel norms read them as Shard(1).
    blocks = list(model.layers.values())
    for block in blocks:
        parallelize_module(
            block, tp_mesh, _block_plan(model, block, colwise, rowwise, prepare_input)
        )
    # Pipeline stages exchange plain tensors (this rank's sequence shard): convert at the edges.
    if blocks and model.tok_embeddings is None:
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=False,
            ),
        )
    if blocks and model.norm is None:
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True
            ),
        )
    _apply_mtp_tp(model, tp_mesh, colwise, rowwise, prepare_input)


def _apply_mtp_tp(
    model: Decoder, tp_mesh: DeviceMesh, colwise: type, rowwise: type, prepare_input: type
) -> None:
    """Multi-token prediction depths (DeepSeek-V3; `titanlab.models.common.mtp`) run
    sequence-sharded like the blocks: each depth takes (h, embedding, cos, sin) with h and the
    embedding `Shard(1)` (DTensors, or the plain shards a pipeline stage received), its norms
    and `eh_proj` replicated over tp and applied to each rank's own tokens (their gradients
    summed over the tp ranks, like the block norms'), its block by the block plan; the output
    head then gathers the sequence as for the main loss. A pipeline stage's `mtp_carry` hands
    on plain shards."""
    depths = getattr(model, "mtp", None)
    for depth in depths.values() if depths is not None else []:
        parallelize_module(
            depth,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1), Shard(1), None, None),
                desired_input_layouts=(Shard(1), Shard(1), None, None),
                use_local_output=False,
            ),
        )
        norms = ("enorm", "hnorm", "eh_proj", "norm")
        parallelize_module(depth, tp_mesh, {name: SequenceParallel() for name in norms})
        parallelize_module(
            depth.block, tp_mesh, _block_plan(model, depth.block, colwise, rowwise, prepare_input)
        )
    carrier = getattr(model, "mtp_carry", None)
    if carrier is not None:
        shards = (Shard(1),) * (1 + getattr(model.args, "mtp_layers", 0))
        parallelize_module(
            carrier,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=shards, desired_input_layouts=shards, use_local_output=True
            ),
        )


def _block_plan(
    model: Decoder, block: nn.Module, colwise: type, rowwise: type, prepare_input: type
) -> dict[str, ParallelStyle]:
    """The plan of one block of `model`: GQA or MLA attention, dense or MoE feed-forward."""
    moes = moe_layers(block)
    attention = getattr(block, "attention", None)
    mla = None
    if isinstance(attention, MLAttention):
        mla = mla_attention_plan(
            colwise,
            rowwise,
            q_lora=attention.wq is None,
            qk_rope_head_dim=attention.qk_rope_head_dim,
        )
    return decoder_block_plan(
        colwise,
        rowwise,
        prepare_input,
        qk_norm=model.args.qk_norm,
        moe=bool(moes),
        shared_experts=bool(moes) and moes[0].shared_experts is not None,
        mla=mla,
        sinks=getattr(attention, "sinks", None) is not None,
        linear=isinstance(attention, GatedDeltaNet),
        shared_gate=bool(moes) and moes[0].shared_gate is not None,
    )


def linear_split_dims(model: Decoder) -> dict[str, int]:
    """Module name → the dim of its weight that `apply_tp` splits (0: column-wise, by output
    rows; 1: row-wise, by input columns), for every Linear it splits in `model` (a meta-device
    model is enough); read from the same plan `apply_tp` applies."""
    dims = {"output": 0} if model.output is not None else {}
    blocks = {f"layers.{index}": block for index, block in model.layers.items()}
    depths = getattr(model, "mtp", None)  # multi-token prediction depths' blocks (`_apply_mtp_tp`)
    for k, depth in depths.items() if depths is not None else []:
        blocks[f"mtp.{k}.block"] = depth.block
    for prefix, block in blocks.items():
        plan = _block_plan(model, block, ColwiseParallel, RowwiseParallel, PrepareModuleInput)
        for path, style in plan.items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                dims[f"{prefix}.{path}"] = 0 if isinstance(style, ColwiseParallel) else 1
    return dims


def block_comm_bytes(dim: int, tokens: int, elem: int = 4) -> dict[str, int]:
    """Bytes one rank communicates for one transformer block's forward and backward under 1D
    tensor parallel with sequence parallel, by collective kind, as
    `titanlab.distributed.comm_counter` counts them (an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor); `tokens`: b · s of the microbatch, `elem` bytes per element.

    Megatron-LM with sequence parallel (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2):
    forward all-gathers the two norms' outputs (tokens × dim each) and reduce-scatters wo's and
    w2's outputs; backward mirrors each (reduce-scatter, all-gather). Independent of the
    degree: only (n-1)/n of each reaches the wire. The two norm weights' gradients (dim each)
    stay partial sums through backward and are all-reduced when first read (the gradient
    norm), outside the block's forward and backward.
    """
    act = tokens * dim * elem
    return {"all_gather": 4 * act, "reduce_scatter": 4 * act, "all_reduce": 0}
