"""The tensor-parallel plan of multi-head latent attention (`titanlab.models.common.mla`).

MLA's heads split like GQA's (Megatron-LM style): the query projection (`wq`, or `wq_b` after
the compressed query) and the key-value up-projection `wkv_b` column-wise, by heads; `wo`
row-wise, its output reduce-scattered onto sequence shards. The down-projections `wq_a` and
`wkv_a` and the two latent RMSNorms are small and shared by every head, so they are
replicated (`ReplicateParallel`): every tp rank computes the whole latent from the gathered
sequence.

One gradient needs a sum the styles do not make by themselves: the rotary key `k_rope` is one
head broadcast to all heads, so each tp rank's heads give only a part of its gradient. The
latent `c_kv` is summed by `wkv_b`'s column-wise input (the usual Megatron "f" operator), but
`k_rope` goes to the attention without a Linear, so `wkv_a`'s style sums the gradient of those
last `qk_rope_head_dim` output columns over the tp ranks itself (`_SumGradTail`). Without it the
run trains silently wrong (each rank's wkv_a rope rows would see its own heads only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class _SumGradTail(torch.autograd.Function):
    """Identity forward; backward sums the gradient of the last `tail` features over `mesh`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tail: int, mesh: DeviceMesh) -> torch.Tensor:
        ctx.tail, ctx.mesh = tail, mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        head, tail = grad.split([grad.shape[-1] - ctx.tail, ctx.tail], dim=-1)
        tail = funcol.all_reduce(tail.contiguous(), "sum", ctx.mesh)
        return torch.cat((head, tail), dim=-1), None, None


class ReplicateParallel(ParallelStyle):
    """A module replicated over the tp mesh: its parameters become `Replicate` DTensors (their
    gradients are each rank's full gradient, like the sequence-parallel norms'), its input a
    replicated DTensor, its output a plain tensor.

    Args:
        sum_grad_tail: sum the gradient of the output's last `sum_grad_tail` features over the
            tp ranks in backward (0: none); see the module docstring.
    """

    def __init__(self, sum_grad_tail: int = 0) -> None:
        super().__init__()
        self.sum_grad_tail = sum_grad_tail

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(
                name, nn.Parameter(replicated, requires_grad=param.requires_grad)
            )

        def prepare_input(_mod: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
            (x,) = inputs
            if isinstance(x, DTensor):
                return (x.redistribute(device_mesh, [Replicate()]),)
            return (DTensor.from_local(x, device_mesh, [Replicate()], run_check=False),)

        def prepare_output(_mod: nn.Module, _inputs: Any, out: DTensor) -> torch.Tensor:
            local = out.to_local()
            if self.sum_grad_tail:
                local = _SumGradTail.apply(local, self.sum_grad_tail, device_mesh)
            return local

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        return module


def mla_attention_plan(
    colwise: type, rowwise: type, *, q_lora: bool, qk_rope_head_dim: int
) -> dict[str, ParallelStyle]:
    """Module path within a block → style for `MLAttention` (its input, the gathered sequence,
    is prepared by the block plan's "attention" entry).

    Args:
        colwise, rowwise: the column-/row-wise style classes.
        q_lora: the attention compresses its query (`wq_a` → `q_a_norm` → `wq_b`), else `wq`.
        qk_rope_head_dim: width of the rotary key at the end of `wkv_a`'s output.
    """
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": ReplicateParallel(sum_grad_tail=qk_rope_head_dim),
        "attention.kv_a_norm": ReplicateParallel(),
        "attention.wkv_b": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
    }
    if q_lora:
        plan["attention.wq_a"] = ReplicateParallel()
        plan["attention.q_a_norm"] = ReplicateParallel()
        plan["attention.wq_b"] = colwise()
    else:
        plan["attention.wq"] = colwise()
    return plan
