"""The decoder-only transformer every family builds: embedding → blocks → RMSNorm → output.

The model knows nothing of parallelism: tensor/pipeline/data parallelism is applied from outside
(see `titanlab/distributed/`). Two conventions make that possible:
- `Attention` derives its number of heads from the projected tensor's size, so column-sharding
  wq/wk/wv makes it run on the local heads;
- `layers` is a `ModuleDict` keyed by str(layer_id), and `tok_embeddings`, `norm`, `output` may be
  set to None, so a pipeline stage keeps only its own layers.

A family's args (`DecoderArgs`) choose what differs: head_dim, the SwiGLU width, per-head q/k
norms, RoPE base and scaling, tied embeddings, the attention (grouped-query by default,
multi-head latent with `attention_type = "mla"`), and, for Mixture-of-Experts families, which blocks
replace the dense FFN by an `MoE` (a `moe_layer(layer_id) -> MoEArgs | None` method on the args;
families without it are dense).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

import torch
from torch import nn

from titanlab.models.common.feed_forward import FeedForward
from titanlab.models.common.document_mask import attention_masks
from titanlab.models.common.init import normal_, trunc_normal_
from titanlab.models.common.kv_cache import KVCache, LayerCache
from titanlab.models.common.aux_loss import add_loss_grad
from titanlab.models.common.mtp import (
    MTPModule,
    MTPCarry,
    carries_mtp,
    mtp_embeddings,
    mtp_loss_sum,
    uncarry,
)
from titanlab.models.common.moe import MoE, MoEArgs
from titanlab.models.common.rope import RopeScaling, YarnScaling, precompute_rope_cos_sin
from titanlab.models.common.token_mixer import (
    TokenMixer,
    build_token_mixer,
    has_local_attention,
    is_linear_layer,
    layer_window,
    norm_class,
    rope_dim,
)

__all__ = ["Decoder", "DecoderArgs", "TransformerBlock", "has_local_attention", "layer_window"]


class DecoderArgs(Protocol):
    """What `Decoder` reads from a family's args dataclass."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> RopeScaling | YarnScaling | None: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def depth_init(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...

    def ffn_hidden_dim(self) -> int: ...
    def validate(self) -> None: ...


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, layer_id: int, args: DecoderArgs):
        super().__init__()
        norm = norm_class(args)
        self.attention_norm = norm(args.dim, eps=args.norm_eps)
        self.attention: TokenMixer = build_token_mixer(args, layer_id)
        self.ffn_norm = norm(args.dim, eps=args.norm_eps)
        moe_layer = getattr(args, "moe_layer", None)
        moe_args = moe_layer(layer_id) if moe_layer is not None else None
        self.feed_forward: FeedForward | MoE = (
            FeedForward(args.dim, args.ffn_hidden_dim())
            if moe_args is None
            else MoE(args.dim, moe_args)
        )
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()  # type: ignore[operator]
        self.attention.init_weights(self.out_init_std)
        self.ffn_norm.reset_parameters()  # type: ignore[operator]
        self.feed_forward.init_weights(self.out_init_std)

    def forward(
        self,
        x_bsd: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerCache | None = None,
        mask: Any = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim); `kv` only when generating, `mask` only with
        document masking (see `Attention`), `segments` only for a linear-attention block with
        packed documents (see `GatedDeltaNet`)."""
        x = self.attention_norm(x_bsd)
        # Attention gets exactly (x, cos, sin) positionally: the tensor-parallel plan prepares
        # those three inputs; the cache and the document mask go as keywords, which it leaves
        # alone.
        extra: dict[str, Any] = {}
        if kv is not None:
            extra["kv"] = kv
        if mask is not None:
            extra["mask"] = mask
        if segments is not None:
            extra["segments"] = segments
        h = x_bsd + self.attention(x, cos, sin, **extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Embedding -> n_layers blocks -> RMSNorm -> output projection.

    With `args.tie_word_embeddings`, `output.weight` is the same Parameter as
    `tok_embeddings.weight`; such a model cannot be split across pipeline stages (the first and
    last stage would each hold a copy that nothing keeps in sync).

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    # Declared for type checkers: a pipeline stage sets the modules it does not own to None,
    # and the RoPE tables are (non-persistent) buffers.
    args: DecoderArgs
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Linear | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: DecoderArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = norm_class(args)(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Multi-token prediction depths (DeepSeek-V3; `common/mtp.py`), each with the block of
        # layer id n_layers + k; computed only inside `mtp_targets` (training).
        depths = getattr(args, "mtp_layers", 0)
        self.mtp: nn.ModuleDict | None = None
        if depths:
            self.mtp = nn.ModuleDict(
                {
                    str(k): MTPModule(
                        args.dim, args.norm_eps, TransformerBlock(args.n_layers + k, args)
                    )
                    for k in range(depths)
                }
            )
        self.mtp_carry = MTPCarry() if depths else None  # pipeline stages: see forward
        self.mtp_active = False  # inside `mtp_targets`: the depths' loss is computed
        self.mtp_labels: torch.Tensor | None = None
        self.mtp_grad_scale: Any = 0.0
        self.last_mtp_loss: torch.Tensor | None = None
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = precompute_rope_cos_sin(
            rope_dim(args), args.max_seq_len, args.rope_theta, args.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, rope_dim/2)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module conversions that cannot reuse the tensor in place (meta -> cpu/cuda in
        # `to_empty`) give each module its own new Parameter, silently untying the weights.
        super()._apply(fn, recurse)
        emb, out = self.tok_embeddings, self.output
        if self.args.tie_word_embeddings and emb is not None and out is not None:
            if out.weight is not emb.weight:
                out.weight = emb.weight
        return self

    @torch.no_grad()
    def reset_rope(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables (non-persistent buffers, e.g. after `to_empty`) on `device`
        (default: the tables' current device)."""
        device = self.rope_cos.device if device is None else device
        self.rope_cos, self.rope_sin = precompute_rope_cos_sin(
            rope_dim(self.args),
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE tables and initialise every parameter in place.

        Deterministic given the global torch seed (modules are visited in a fixed order:
        embedding, layers by id, norm, output). Works after `to_empty` from the meta device and
        with modules set to None. Recipe (torchtitan's Llama init, itself after OLMo):
        - tok_embeddings: normal(0, 1);
        - wq, wk, wv, w1: truncated normal std 0.02;
        - wo, w2, w3: std 0.02 / sqrt(2 * (layer_id + 1)) if depth_init else
          0.02 / sqrt(2 * n_layers);
        - RMSNorm weights (q/k norms included): ones;
        - output: truncated normal std dim ** -0.5.
        Every truncated normal is cut at +-3 std (torchtitan cuts at +-2 absolute, i.e. not at
        all at std 0.02). A tied embedding/output weight gets the output recipe, so initial
        logits stay O(1).

        Args:
            buffer_device: device for the RoPE tables; default the tables' current device.
        """
        self.reset_rope(buffer_device)
        if self.tok_embeddings is not None and not self.args.tie_word_embeddings:
            normal_(self.tok_embeddings.weight, 1.0)
        for layer_id in sorted(self.layers.keys(), key=int):
            cast(TransformerBlock, self.layers[layer_id]).init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()  # type: ignore[operator]
        if self.output is not None:
            trunc_normal_(self.output.weight, self.args.dim**-0.5)
        elif self.args.tie_word_embeddings and self.tok_embeddings is not None:
            trunc_normal_(self.tok_embeddings.weight, self.args.dim**-0.5)
        if self.mtp is not None:
            for k in sorted(self.mtp.keys(), key=int):
                cast(MTPModule, self.mtp[k]).init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the (possibly partial, per pipeline stage) model.

        Args:
            tokens: (bs, seq) int64 token ids, or (bs, seq, dim) float hidden states when
                `tok_embeddings` is None (a middle or last pipeline stage).
            cache: generation only: the tokens continue the sequences held in `cache`, at
                each sequence's own RoPE positions (`KVCache`); training never passes one.
            segments: document masking (training): (bs, seq) int64 document index of each
                token (`titanlab.data.segments.document_ids`); attention stays inside documents.
            positions: (bs, seq) int64 RoPE position of each token (e.g. restarting per
                document); None: 0..seq-1.
        Returns:
            (bs, seq, vocab) logits in the compute dtype, or (bs, seq, dim) hidden states when
            `norm` / `output` are None ((bs, seq, (1 + D) · dim) on a pipeline stage that
            carries D trained MTP depths' embeddings, `titanlab.models.common.mtp.MTPCarry`).
        Raises:
            ValueError: if seq exceeds `args.max_seq_len` (the RoPE table length).
        """
        carried: list[torch.Tensor] = []  # the MTP depths' embeddings, between pipeline stages
        if self.tok_embeddings is None:
            h = tokens
            if carries_mtp(self):
                h, carried = uncarry(tokens, self.args.dim)
        else:
            h = self.tok_embeddings(tokens)
            if carries_mtp(self):  # a first pipeline stage
                carried = mtp_embeddings(
                    self.tok_embeddings, tokens, getattr(self.args, "mtp_layers", 0)
                )
        seq = h.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.rope_cos.shape[0]}")
        local = has_local_attention(self.args)
        masks = None
        if cache is None:
            windows = [layer_window(self.args, int(key)) for key in self.layers]
            masks = attention_masks(segments, positions, windows, local, seq, h.device)
        if segments is not None or positions is not None or masks is not None:
            cos, sin = self.rope_cos, self.rope_sin
            if positions is not None:
                cos, sin = cos[positions], sin[positions]  # (bs, seq, hd/2)
            for key, layer in self.layers.items():
                window = layer_window(self.args, int(key))
                extra = {"mask": masks[window]} if masks is not None else {}
                if segments is not None and is_linear_layer(self.args, int(key)):
                    extra["segments"] = segments  # the recurrence restarts per document
                h = layer(h, cos, sin, **extra)
        elif cache is None:
            for layer in self.layers.values():
                h = layer(h, self.rope_cos, self.rope_sin)  # (bs, seq, dim)
        else:
            positions = cache.begin(seq)  # (bs, seq)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (bs, seq, hd/2)
            for key, layer in self.layers.items():
                h = layer(h, cos, sin, cache.layer(int(key)))
            cache.end()
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return cast(nn.Module, self.mtp_carry)(h, *carried) if carried else h
        out = self.output(h)
        if self.mtp is not None and self.mtp_active and self.mtp_labels is not None:
            assert segments is None and positions is None and cache is None, "refused by config"
            if not carried:
                carried = mtp_embeddings(
                    cast(nn.Module, self.tok_embeddings), tokens, len(self.mtp)
                )
            loss = mtp_loss_sum(
                self.mtp, self.output, carried, h, self.mtp_labels, self.rope_cos, self.rope_sin
            )
            done = loss.detach()
            self.last_mtp_loss = done if self.last_mtp_loss is None else self.last_mtp_loss + done
            if torch.is_grad_enabled() and self.training:
                out = add_loss_grad(out, loss, self.mtp_grad_scale)
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model` (or of a pipeline stage of it), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_layer_args(args) -> list[MoEArgs]:
    """The MoEArgs of every MoE block of the whole model, multi-token prediction depths
    included, from its args alone (no module built): empty for a dense family (args without
    `moe_layer`)."""
    moe_layer = getattr(args, "moe_layer", None)
    if moe_layer is None:
        return []
    blocks = args.n_layers + getattr(args, "mtp_layers", 0)  # MTP depths: layer ids L, L+1, ..
    return [a for i in range(blocks) if (a := moe_layer(i)) is not None]
