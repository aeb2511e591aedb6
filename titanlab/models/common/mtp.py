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

Every depth runs over the whole sequence, as Megatron-Core's MTP does (its `roll_tensor`): the
tokens are rolled k places left (the last k filled with token 0) and embedded, and the targets
rolled likewise (the last k ignored). Causal attention keeps the k filler positions from every
real one, so the loss equals the paper's shortened sequences; the filler tokens do reach the
depth's MoE load statistics (k of seq tokens per sequence, as in Megatron-Core). Keeping the
length is what lets the depths run sequence-sharded under tensor parallel and ride the pipeline
boundary: under pipeline parallel the first stage embeds the rolled tokens and every stage
boundary carries them beside the hidden state (`MTPCarry`, `uncarry`), since only the first stage
holds the embedding; the last stage holds the depths.
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
        self,
        h_prev: torch.Tensor,
        emb: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: Any = None,
    ) -> torch.Tensor:
        """h_prev, emb: (bs, seq', dim), the previous depth's state and the embedding of the
        token k places ahead at each position; cos, sin: the RoPE tables (>= seq' rows), or
        each position's rows (bs, seq', rope dim) when decoding; kv: the block's `LayerCache`
        when decoding (`titanlab.generation.mtp_draft`). Returns h^k, (bs, seq', dim)."""
        h = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h_prev)), dim=-1))
        return self.norm(self.block(h, cos, sin, kv=kv))


def rolled(tokens: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """`tokens` ((bs, seq) int64) rolled k places left along the sequence, the last k set to
    `fill` (Megatron-Core's `roll_tensor`): position i holds tokens[:, i + k]."""
    out = torch.roll(tokens, -k, dims=1)
    out[:, max(tokens.shape[1] - k, 0) :] = fill
    return out


def mtp_embeddings(embedding: nn.Module, tokens: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The embedding of the tokens each depth reads: [Emb(tokens rolled k left) for k in
    1..depths], each (bs, seq, dim); `tokens` (bs, seq) int64 are the main model's inputs."""
    return [embedding(rolled(tokens, k, 0)) for k in range(1, depths + 1)]


def trains_mtp(args: Any) -> bool:
    """Whether model args train MTP depths: mtp_layers and mtp_loss_weight above 0."""
    return getattr(args, "mtp_layers", 0) > 0 and getattr(args, "mtp_loss_weight", 0) > 0


def boundary_width(args: Any) -> int:
    """Vectors of width dim a pipeline boundary carries per token for model `args`: 1 (the
    hidden state), plus one embedding per trained MTP depth (`MTPCarry`)."""
    return 1 + (args.mtp_layers if trains_mtp(args) else 0)


def carries_mtp(model: Any) -> bool:
    """Whether `model` (a `Decoder`) is a pipeline stage whose boundaries carry the embeddings
    of trained MTP depths (`MTPCarry`): it lacks the embedding or the head and `trains_mtp`."""
    if model.tok_embeddings is not None and model.output is not None:
        return False
    return trains_mtp(model.args)


class MTPCarry(nn.Module):
    """Joins a pipeline stage's output with the depths' embeddings beside the hidden state:
    forward(h, e_1, .., e_D) -> (bs, seq, (1 + D) · dim), [h ; e_1 ; ... ; e_D] along the last
    dim. A module (without parameters) so that a parallel plan can lay out its inputs."""

    def forward(self, h: torch.Tensor, *embeds: torch.Tensor) -> torch.Tensor:
        return torch.cat((h, *embeds), dim=-1)


def uncarry(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Inverse of `MTPCarry`: (h, [e_1 .. e_D]) from a (bs, seq, (1 + D) · dim) stage input."""
    h, *embeds = x.split(dim, dim=-1)
    return h, embeds


def mtp_loss_sum(
    mtp: nn.ModuleDict,
    head: nn.Module,
    embeds: list[torch.Tensor],
    h0: torch.Tensor,
    labels: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The summed token cross-entropy of every MTP depth, 0-dim fp32 (a replicated DTensor
    when the head's logits are vocab-sharded, under loss parallel).

    Args:
        mtp: the depths, keyed "0".."D-1" (depth k+1 under key k).
        head: the main model's output head: a Linear returning logits, or a fused-loss head
            (`titanlab.components.fused_head.FusedLossHead` with `labels` set) returning the
            summed cross-entropy of its `labels`, which are swapped for each depth's.
        embeds: D tensors (bs, seq, dim), `mtp_embeddings` of the main model's inputs; h0:
            (bs, seq, dim) the main model's output after its final norm; labels: (bs, seq)
            int64 next-token labels, -100 ignored.
        cos, sin: the RoPE tables.
    """
    total: torch.Tensor | None = None
    h = h0
    fused_labels = getattr(head, "labels", None)
    for k in range(1, len(mtp) + 1):
        h = mtp[str(k - 1)](h, embeds[k - 1], cos, sin)  # (bs, seq, dim)
        targets = rolled(labels, k, IGNORE_INDEX)
        if fused_labels is not None:
            head.labels = targets
            try:
                loss = head(h).float()
            finally:
                head.labels = fused_labels
        else:
            logits = head(h).float()
            loss = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        total = loss if total is None else total + loss
    assert total is not None, "mtp has at least one depth"
    return total


@contextlib.contextmanager
def mtp_targets(model: nn.Module, labels: torch.Tensor | None, grad_scale: Any) -> Iterator[None]:
    """Within, `model(inputs)` (a `Decoder` with MTP depths, or the last pipeline stage of one)
    also computes the MTP loss against `labels` ((bs, seq) int64, -100 ignored; None: each
    forward's own, which a pipeline stage's hook sets in `model.mtp_labels`), weighted by
    `grad_scale` in backward, and keeps it (summed over depths and forwards, detached) in
    `model.last_mtp_loss`."""
    decoder: Any = model
    decoder.mtp_active, decoder.mtp_labels = True, labels
    decoder.mtp_grad_scale, decoder.last_mtp_loss = grad_scale, None
    try:
        yield
    finally:
        decoder.mtp_active, decoder.mtp_labels, decoder.mtp_grad_scale = False, None, 0.0
