"""Multi-token prediction (MTP; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
arXiv:2412.19437, §2.2), as DeepSeek's checkpoints and transformers' `MtpLayer` lay it out.

D sequential modules extend the model's prediction depth. Module k (1..D) at position i combines
the previous depth's hidden state h^{k-1}_i (depth 0: the main model's output after its final
norm, as transformers and vLLM pass it) with the embedding of the token k places ahead:
`h' = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])` (embedding first, the checkpoints'
order; the paper's eq. 21 writes h first), runs one decoder block over the shortened sequence,
and normalizes: `h^k = norm(block(h'))`, which predicts t_{i+k+1} through the main model's
output head; `h^k` is also the next depth's input. The embedding and head are the main model's.

Training loss (the paper's L_MTP = λ/D · Σ_k L^k): each depth's summed token cross-entropy
against the labels shifted by k (titanlab's label y_i is t_{i+1}, so depth k's target at
position i is y_{i+k}), weighted by `mtp_grad_scale` (the trainer sets λ/D times its own loss
scale) and sent into backward through the main output, as the MoE load-balance loss is. The
model computes it only inside `mtp_targets(model, labels)`; validation and generation skip it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common.init import trunc_normal_

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One MTP depth: `enorm`, `hnorm` (RMSNorm over dim), `eh_proj` ((dim, 2·dim), columns
    [0, dim) act on the embedding), one decoder `block`, and the output `norm`.

    Args:
        dim: model width; norm_eps: the RMSNorms' eps.
        block: the depth's transformer block (DeepSeek-V3: MLA + MoE).
    """

    def __init__(self, dim: int, norm_eps: float, block: Any) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block: Any = block  # a `TransformerBlock` (decoder.py imports this module)
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def init_weights(self) -> None:
        """Norms ones, `eh_proj` truncated normal std 0.02, the block by its own recipe."""
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, 0.02)
        self.block.init_weights()

    def forward(
        self, h_prev: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """h_prev, emb: (bs, seq', dim), the previous depth's state and the embedding of the
        token k places ahead at each position; cos, sin: the RoPE tables (>= seq' rows).
        Returns h^k, (bs, seq', dim)."""
        h = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h_prev)), dim=-1))
        return self.norm(self.block(h, cos, sin))


def mtp_loss_sum(
    mtp: nn.ModuleDict,
    head: nn.Module,
    embed: torch.Tensor,
    h0: torch.Tensor,
    labels: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The summed token cross-entropy of every MTP depth, 0-dim fp32.

    Args:
        mtp: the depths, keyed "0".."D-1" (depth k+1 under key k).
        head: the main model's output head: a Linear returning logits, or a fused-loss head
            (`titanlab.components.fused_head.FusedLossHead` with `labels` set) returning the
            summed cross-entropy of its `labels`, which are swapped for each depth's.
        embed: (bs, seq, dim) the main model's token embeddings; h0: (bs, seq, dim) its output
            after the final norm; labels: (bs, seq) int64 next-token labels, -100 ignored.
        cos, sin: the RoPE tables.
    """
    seq = h0.shape[1]
    total = torch.zeros((), dtype=torch.float32, device=h0.device)
    h = h0
    fused_labels = getattr(head, "labels", None)
    for k in range(1, len(mtp) + 1):
        if k >= seq:
            break
        h = mtp[str(k - 1)](h[:, : seq - k], embed[:, k:], cos, sin)  # (bs, seq - k, dim)
        targets = labels[:, k:]
        if fused_labels is not None:
            head.labels = targets
            try:
                total = total + head(h).float()
            finally:
                head.labels = fused_labels
        else:
            logits = head(h).float()
            total = total + F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
    return total


@contextlib.contextmanager
def mtp_targets(model: nn.Module, labels: torch.Tensor, grad_scale: Any) -> Iterator[None]:
    """Within, `model(inputs)` (a `Decoder` with MTP depths) also computes the MTP loss against
    `labels` ((bs, seq) int64, -100 ignored), weighted by `grad_scale` in backward, and keeps
    it (summed over depths, detached) in `model.last_mtp_loss`."""
    decoder: Any = model
    decoder.mtp_labels, decoder.mtp_grad_scale = labels, grad_scale
    try:
        yield
    finally:
        decoder.mtp_labels, decoder.mtp_grad_scale = None, 0.0
