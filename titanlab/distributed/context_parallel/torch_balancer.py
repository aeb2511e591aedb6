"""titanlab's context-parallel load balancers as PyTorch's `_LoadBalancer`, for code that shards
through torch's own context-parallel API (torch 2.13's `_context_parallel_shard`, which
FlexAttention CP takes its buffers from, and `_create_cp_block_mask`, which rearranges its mask
by the same indices): the order a titanlab balancer gives (`balance.shard_order`: `work`
weighs each block of tokens by the keys its document mask lets them see) in torch's convention,
the rearranged sequence whose r-th contiguous piece is rank r's tokens.

titanlab's trainer shards its batches itself (`documents.shard_batch`, the same order); the
adapter lets a torch-API user balance document-masked batches by work where torch's own
`_PerDocumentHeadTailLoadBalancer` needs every document's length a multiple of 2·cp and keeps
each document's chunks together (docs/parallelism.md, the figures of both).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _LoadBalancer

from titanlab.distributed.context_parallel.balance import shard_order


class TitanlabLoadBalancer(_LoadBalancer):
    """A titanlab balancer's order as torch's `_LoadBalancer`.

    Args:
        segments: (bs, S) int64 document ids of the batch (None: one causal document per row).
        seq, batch: S and bs. cp: context parallel degree (divides S; 2·cp for head_tail).
        balancer: one of `balance.BALANCERS` ("work" by default).
    Raises:
        ValueError: as `shard_order` (an unknown balancer, S not divisible by cp).
    """

    def __init__(
        self, segments: torch.Tensor | None, seq: int, batch: int, cp: int, balancer: str = "work"
    ) -> None:
        self.order = shard_order(segments, seq, batch, cp, balancer)

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        """(bs, S) int64: the rearranging indices (token j of the rearranged sequence is token
        `indices[:, j]` of the batch), or with `restore` their inverse."""
        return self.order.argsort(dim=1) if restore else self.order
