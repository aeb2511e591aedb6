"""Tensor parallel for generation: each rank holds its share of the heads and of the MLP.

Training's plan shards activations along the sequence between blocks (sequence parallel), which
a one-token decode step cannot split; generation uses Megatron-LM's plain scheme instead
(Shoeybi et al. 2019): q/k/v and w1/w3 split by output (column-wise), wo and w2 by input
(row-wise, their outputs all-reduced), so activations stay whole (replicated) between blocks.
Attention finds its local head counts from the projections' sizes, and the KV cache holds the
local heads. Embedding, norms and output projection stay replicated, so every rank computes the
same logits and samples the same token with the same seed. A linear-attention layer (Qwen3.5)
splits its key heads with their value heads the same way: `wqkv` (grouped by key head), `wz`,
`wb`, `wa` column-wise, the convolution's channels and the decay's heads with them, `wo`
row-wise; its recurrent cache holds the local heads' state.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titanlab.distributed.tensor_parallel.plan import ShardHeads
from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.linear_attention import GatedDeltaNet


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
    keys = getattr(args, "linear_key_heads", tp)
    if keys % tp:
        raise ValueError(
            f"{tp} ranks must divide the linear-attention layers' key heads ({keys}); use "
            "NGPU dividing them"
        )
    mlp = {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    attention = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    linear = {
        **{f"attention.{w}": ColwiseParallel() for w in ("wqkv", "wz", "wb", "wa")},
        "attention.conv": ShardHeads(),
        "attention.decay": ShardHeads(),
        "attention.wo": RowwiseParallel(),
    }
    for block in getattr(model, "layers").values():  # noqa: B009
        mixer = linear if isinstance(block.attention, GatedDeltaNet) else attention
        parallelize_module(block, mesh, {**mixer, **mlp})
