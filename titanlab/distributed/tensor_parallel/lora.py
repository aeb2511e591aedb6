"""Tensor-parallel styles for Linear layers that may carry a LoRA adapter
(`titanlab.peft.lora.LoRALinear`: W x + s · B A x).

The adapter follows its base Linear's split (Hu et al. 2021 give the formula; the split is the
one that keeps every product local, as Megatron-LM splits an MLP):
- column-wise base (W sharded by output rows): A (r × in) replicated, B (out × r) split by rows
  like W, so B A x comes out sharded on the last dim like W x;
- row-wise base (W sharded by input columns, the input sharded on its last dim): A split by
  columns like W, so A x is a partial sum, and B replicated; W x and B A x are then partial sums
  reduced together by the style's output redistribution.
A plain Linear is split exactly as torch's `ColwiseParallel` / `RowwiseParallel` split it. A
QLoRA base weight (NF4) is split into NF4 shards whose values equal the whole weight's
(`titanlab.peft.nf4_split`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titanlab.peft.nf4_split import is_quantized, nf4_shard


def _distribute_own(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank
) -> None:
    """Make each direct parameter of `module` named in `placements` a DTensor placed so. An NF4
    weight (QLoRA) is held whole by every rank; each keeps its own shard of it."""
    for name, param in list(module.named_parameters(recurse=False)):
        if name not in placements:
            continue
        placement = placements[name]
        if is_quantized(param):
            assert isinstance(placement, Shard)
            shard = nf4_shard(param, placement.dim, mesh.get_local_rank(), mesh.size())
            dist = DTensor.from_local(
                shard, mesh, [placement], shape=param.shape, stride=param.stride(), run_check=False
            )
        else:
            dist = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` that also splits a LoRA adapter: A replicated, B by rows."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "lora_a":
            placements: dict[str, Placement] = {"weight": Replicate()}
        else:  # the base Linear (weight and bias by output rows) or lora_b
            placements = {"weight": Shard(0), "bias": Shard(0)}
        _distribute_own(module, device_mesh, placements, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` that also splits a LoRA adapter: A by columns, B replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "lora_b":
            placements: dict[str, Placement] = {"weight": Replicate()}
        else:  # the base Linear (weight by input columns, bias replicated) or lora_a
            placements = {"weight": Shard(1), "bias": Replicate()}
        _distribute_own(module, device_mesh, placements, self.src_data_rank)
