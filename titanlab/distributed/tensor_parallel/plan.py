"""The tensor-parallel plan of one decoder block (`titanlab.models.common.decoder`), applied from
outside the model by `titanlab.distributed.tensor_parallel.one_d.apply_tp`.

Megatron-LM style (Shoeybi et al. 2019) with sequence parallel (Korthikanti et al. 2022): wq/wk/
wv and w1/w3 column-wise, so attention runs on the local heads; wo and w2 row-wise, their outputs
reduce-scattered onto sequence shards; the block norms normalize each rank's own tokens. The
per-head q/k norms (Qwen3) see (bs, seq, local heads, head_dim): the heads dim (2) is the sharded
one, their weight (head_dim,) is replicated, and their output goes back to a plain tensor for
RoPE. `titanlab.distributed.tensor_parallel.one_d.apply_tp` applies this plan to every block.

An MoE block's experts are not tensor-parallel: its MoE layer runs on each tp rank's own sequence
shard (local tokens in, local outputs out, declared `Shard(1)` again), and expert parallel, whose
ep ranks include the tp ranks, carries the tokens to their experts. The router's gate and the
shared experts are replicated over tp and see each rank's tokens as a `Shard(0)` DTensor (torch's
`SequenceParallel` on dim 0), so their weight gradients are summed over the tp ranks like the
norms'.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInputOutput,
)
from torch.distributed.tensor.parallel import SequenceParallel as _TorchSequenceParallel


class SequenceParallel(_TorchSequenceParallel):
    """torch's `SequenceParallel`, except that a replicated parameter keeps `requires_grad`:
    torch 2.13 re-creates each one as trainable, which trained the frozen norms of a LoRA
    run under TP; and that a module with children (the shared experts' SwiGLU) works: torch
    calls this for every submodule but registers each one's parameters recursively, under
    dotted names `register_parameter` refuses."""

    def _replicate_module_fn(self, name, module, device_mesh):
        for p_name, param in module.named_parameters(recurse=False):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(
                p_name, torch.nn.Parameter(replicated, requires_grad=param.requires_grad)
            )


class ShardHeads(ParallelStyle):
    """A module holding parameters with one row per attention head or channel, which its
    `forward()` returns (gpt-oss's sinks, `weight` (n_heads,); a linear-attention layer's
    convolution (C, 1, K) and decay parameters (H_v,)): each tp rank keeps the block of rows its
    column-split projections compute (`Shard(0)`), and the module returns those local rows as
    plain tensors. The rows are disjoint across the ranks, so each rank's gradient is its own
    (nothing to reduce over tp)."""

    def _apply(self, module, device_mesh):
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)])
            module.register_parameter(name, torch.nn.Parameter(sharded, param.requires_grad))
        module.register_forward_hook(lambda _m, _inputs, out: _local(out))
        return module


def _local(out):
    if isinstance(out, tuple):
        return tuple(_local(t) for t in out)
    return out.to_local() if isinstance(out, DTensor) else out


def linear_attention_plan(colwise: type, rowwise: type) -> dict[str, ParallelStyle]:
    """A Gated DeltaNet block's token mixer (`titanlab.models.common.linear_attention`): its
    projections column-wise (`wqkv`'s rows grouped by key head, so each rank holds whole key
    heads with their value heads; `wz`, `wb`, `wa` by value head), the convolution's channels
    and the decay's heads split alike, the per-head gated norm's weight replicated (its gradient
    summed over tp, like the q/k norms'), `wo` row-wise onto sequence shards."""
    return {
        "attention.wqkv": colwise(),
        "attention.wz": colwise(),
        "attention.wb": colwise(),
        "attention.wa": colwise(),
        "attention.conv": ShardHeads(),
        "attention.decay": ShardHeads(),
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
    }


def decoder_block_plan(
    colwise: type,
    rowwise: type,
    prepare_input: type,
    *,
    qk_norm: bool,
    moe: bool = False,
    shared_experts: bool = False,
    mla: dict[str, ParallelStyle] | None = None,
    sinks: bool = False,
    linear: bool = False,
    shared_gate: bool = False,
) -> dict[str, ParallelStyle]:
    """Module path within a block → parallel style.

    Args:
        colwise, rowwise, prepare_input: the style classes (torch's, or torchao's float8 ones).
        qk_norm: the block's attention has `q_norm` / `k_norm`.
        moe: the block's `feed_forward` is an MoE layer; `shared_experts`: it has shared experts.
        mla: the attention is multi-head latent attention, with these styles for its
            projections (`titanlab.distributed.tensor_parallel.mla.mla_attention_plan`) in
            place of GQA's.
        sinks: the attention has per-head sinks (`attention.sinks`), split with their heads.
            Biases of the projections need nothing more: torch's column-wise style splits a
            bias with its rows, the row-wise one replicates it.
        linear: the block's token mixer is linear attention (`linear_attention_plan`).
        shared_gate: the MoE layer's shared experts have a per-token gate (`shared_gate`),
            replicated over tp like them.
    """
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin): only x is a sharded activation; the RoPE tables are plain tensors.
        "attention": prepare_input(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
    }
    if mla is not None or linear:
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo"):
            del plan[name]
        plan.update(mla if mla is not None else linear_attention_plan(colwise, rowwise))
    if moe:
        for name in ("feed_forward", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
            del plan[name]
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
        plan["feed_forward.router.gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
        if shared_experts:
            plan["feed_forward.shared_experts"] = SequenceParallel(
                sequence_dim=0, use_local_output=True
            )
        if shared_gate:
            plan["feed_forward.shared_gate"] = SequenceParallel(
                sequence_dim=0, use_local_output=True
            )
    if sinks:
        plan["attention.sinks"] = ShardHeads()
    if qk_norm and not linear:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan
