"""Llama 3 decoder-only transformer in plain PyTorch.

The model knows nothing of parallelism: tensor/pipeline/data parallelism is applied from outside
(see `titanlab/distributed/`). Two conventions make that possible:
- `Attention` derives its number of heads from the projected tensor's size, so column-sharding
  wq/wk/wv makes it run on the local heads;
- `layers` is a `ModuleDict` keyed by str(layer_id), and `tok_embeddings`, `norm`, `output` may be
  set to None, so a pipeline stage keeps only its own layers.

Architecture follows Meta's reference (github.com/meta-llama/llama-models, `models/llama3/model.py`)
and the Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of Models").
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.llama3.args import RopeScaling, TransformerModelArgs


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE angular frequencies (radians per token), shape (head_dim // 2,) fp32.

    freq_i = theta ** (-2i / head_dim). With `scaling`, the Llama 3.1 rule (Meta llama-models
    `apply_scaling`; Llama 3 paper) rescales each frequency by its wavelength 2*pi/freq, with
    L = original_max_position_embeddings:
    - wavelen > L / low_freq_factor: freq / factor;
    - wavelen < L / high_freq_factor: freq unchanged;
    - otherwise (1 - s) * freq / factor + s * freq, s = (L / wavelen - low) / (high - low).
    """
    freqs = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    )
    if scaling is None:
        return freqs
    orig = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = torch.where(wavelen > orig / low, freqs / scaling.factor, blended)
    return torch.where(wavelen < orig / high, freqs, out)


def precompute_rope_cos_sin(
    head_dim: int,
    end: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles position * freq, each shape (end, head_dim // 2) fp32.

    Frequencies (with optional Llama 3.1 scaling) come from `rope_frequencies`.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by position, Meta's interleaved pair layout, in real arithmetic.

    Elements (2i, 2i+1) of each head form pair i, rotated by angle position * freq_i: the same as
    Meta's `view_as_complex(x.reshape(..., head_dim // 2, 2)) * freqs_cis`, but without complex
    tensors (awkward under DTensor and torch.compile). Math runs in fp32.

    Args:
        xq: (bs, seq, n_heads, head_dim); xk: (bs, seq, n_kv_heads, head_dim), any float dtype.
        cos, sin: (seq, head_dim // 2), from `precompute_rope_cos_sin` sliced to seq.
    Returns:
        (xq, xk) rotated, same shapes and dtypes as the inputs.
    """
    cos = cos[None, :, None, :].float()  # (1, seq, 1, head_dim/2)
    sin = sin[None, :, None, :].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))  # (bs, seq, heads, head_dim/2, 2)
        x_even, x_odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)


def _trunc_normal_(w: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """Truncated normal init at +-cutoff*std (realised std ~0.986*std for cutoff 3)."""
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, no biases."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            _trunc_normal_(w.weight, 0.02)
        _trunc_normal_(self.wo.weight, out_std)

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x_bsd: (bs, seq, dim); cos, sin: (>= seq, head_dim // 2), sliced here to seq.
        Returns (bs, seq, dim).

        Head counts come from the projections' sizes (-1), so under tensor parallelism the module
        runs on the local heads. The RoPE tables are sliced here, to the length attention really
        sees (under sequence parallel the block's input holds only a slice of the sequence).
        """
        bs, seq, _ = x_bsd.shape
        q = self.wq(x_bsd).view(bs, seq, -1, self.head_dim)  # (bs, seq, heads, head_dim)
        k = self.wk(x_bsd).view(bs, seq, -1, self.head_dim)  # (bs, seq, kv_heads, head_dim)
        v = self.wv(x_bsd).view(bs, seq, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, cos[:seq], sin[:seq])
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # kv head j serves q heads j*n_rep .. (j+1)*n_rep-1 (repeat_interleave)
            k = k[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).flatten(2, 3)
            v = v[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).flatten(2, 3)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (bs, heads, seq, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x) (Shazeer 2020), no biases."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        _trunc_normal_(self.w1.weight, 0.02)
        for w in (self.w2, self.w3):
            _trunc_normal_(w.weight, out_std)

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim)."""
        return self.w2(F.silu(self.w1(x_bsd)) * self.w3(x_bsd))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim())
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(self.out_init_std)

    def forward(self, x_bsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim)."""
        h = x_bsd + self.attention(self.attention_norm(x_bsd), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3: embedding -> n_layers blocks -> RMSNorm -> output projection.

    With `args.tie_word_embeddings`, `output.weight` is the same Parameter as
    `tok_embeddings.weight`; such a model cannot be split across pipeline stages (the first and
    last stage would each hold a copy that nothing keeps in sync).

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    # Declared for type checkers: a pipeline stage sets the modules it does not own to None,
    # and the RoPE tables are (non-persistent) buffers.
    args: TransformerModelArgs
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = precompute_rope_cos_sin(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, head_dim/2)
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
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE tables and initialise every parameter in place.

        Deterministic given the global torch seed (modules are visited in a fixed order:
        embedding, layers by id, norm, output). Works after `to_empty` from the meta device and
        with modules set to None. Recipe (torchtitan's Llama init, itself after OLMo):
        - tok_embeddings: normal(0, 1);
        - wq, wk, wv, w1: truncated normal std 0.02;
        - wo, w2, w3: std 0.02 / sqrt(2 * (layer_id + 1)) if depth_init else
          0.02 / sqrt(2 * n_layers);
        - RMSNorm weights: ones;
        - output: truncated normal std dim ** -0.5.
        Every truncated normal is cut at +-3 std (torchtitan cuts at +-2 absolute, i.e. not at
        all at std 0.02). A tied embedding/output weight gets the output recipe, so initial
        logits stay O(1).

        Args:
            buffer_device: device for the RoPE tables; default the tables' current device.
        """
        device = self.rope_cos.device if buffer_device is None else buffer_device
        cos, sin = precompute_rope_cos_sin(
            self.args.head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )
        self.rope_cos, self.rope_sin = cos, sin
        if self.tok_embeddings is not None and not self.args.tie_word_embeddings:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer_id in sorted(self.layers.keys(), key=int):
            cast(TransformerBlock, self.layers[layer_id]).init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal_(self.output.weight, self.args.dim**-0.5)
        elif self.args.tie_word_embeddings and self.tok_embeddings is not None:
            _trunc_normal_(self.tok_embeddings.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the (possibly partial, per pipeline stage) model.

        Args:
            tokens: (bs, seq) int64 token ids, or (bs, seq, dim) float hidden states when
                `tok_embeddings` is None (a middle or last pipeline stage).
        Returns:
            (bs, seq, vocab) logits in the compute dtype, or (bs, seq, dim) hidden states when
            `norm` / `output` are None.
        Raises:
            ValueError: if seq exceeds `args.max_seq_len` (the RoPE table length).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.rope_cos.shape[0]}")
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)  # (bs, seq, dim)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters; shared (tied) tensors are counted once. Works on the meta device.

    With `exclude_embedding`, the token embedding table is left out (it is a lookup, not a
    matmul) unless it is tied to the output projection, which is a matmul and stays counted.
    """
    n = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    if exclude_embedding and emb is not None and (out is None or out.weight is not emb.weight):
        n -= emb.weight.numel()
    return n


def flops_per_token(args: TransformerModelArgs, seq_len: int, n_params_non_embedding: int) -> int:
    """Training (forward + backward) FLOPs per token: 6 * N + 12 * L * H * Q * T.

    N: parameters without the embedding table (the output projection is counted), L: n_layers,
    H: n_heads, Q: head_dim, T: seq_len (tokens). 6N is the dense matmul cost (2 forward +
    4 backward per parameter, Kaplan et al. 2020); 12*L*H*Q*T is the attention score and value
    matmuls with no causal discount (PaLM, Chowdhery et al. 2022, Appendix B).
    """
    return 6 * n_params_non_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def get_nparams_and_flops(
    model: nn.Module,
    args: TransformerModelArgs,
    seq_len: int,
) -> tuple[int, int]:
    """(total parameter count, training FLOPs per token at `seq_len`); see `flops_per_token`."""
    n_non_embedding = count_params(model, exclude_embedding=True)
    return count_params(model), flops_per_token(args, seq_len, n_non_embedding)
