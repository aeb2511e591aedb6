"""Tensor parallel for generation: each rank holds its share of the heads and of the MLP.

Training's plan shards activations along the sequence between blocks (sequence parallel), which
a one-token decode step cannot split; generation uses Megatron-LM's plain scheme instead
(Shoeybi et al. 2019): q/k/v and w1/w3 split by output (column-wise), wo and w2 by input
(row-wise, their outputs all-reduced), so activations stay whole (replicated) between blocks.
Attention finds its local head counts from the projections' sizes, and the KV cache holds the
local heads. Embedding, norms and output projection stay replicated, so every rank computes the
same logits and samples the same token with the same seed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titanlab.models.common.decoder import moe_layers


def apply_generation_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every block of `model` (a dense `Decoder`) over the 1-D `mesh`, in place.

    Raises:
        ValueError: the model has MoE layers, or the mesh size does not divide the heads.
    """
    args: Any = getattr(model, "args")  # noqa: B009 (nn.Module's __getattr__ types)
    tp = mesh.size()
    if moe_layers(model):
        raise ValueError("tensor-parallel generation supports dense models; run MoE on 1 rank")
    if args.n_heads % tp or args.kv_heads % tp:
        raise ValueError(
            f"{tp} ranks must divide the number of heads ({args.n_heads}) and of KV heads "
            f"({args.kv_heads}); use NGPU dividing both"
        )
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in getattr(model, "layers").values():  # noqa: B009
        parallelize_module(block, mesh, plan)
