"""The gated delta rule, the recurrence of Gated DeltaNet's linear-attention layers (Yang, Kautz
and Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
arXiv:2412.06464; Qwen3-Next and Qwen3.5), in PyTorch: token by token (`recurrent`, the
definition, and decoding) and in chunks (`chunked`, training and prefill).

Per head, a state M (d_k × d_v) starts at M_0 (zeros, or a cache's). Token t, with key k_t,
value v_t, query q_t, decay α_t = exp(g_t) ∈ (0, 1] and write strength β_t ∈ (0, 1), updates
and reads it:

    M̃ = α_t M_{t−1}                      (the gate forgets)
    u_t = β_t (v_t − M̃ᵀ k_t)             (the delta rule: write what M̃ mispredicts for k_t)
    M_t = M̃ + k_t u_tᵀ
    o_t = M_tᵀ q_t

**Chunks** (the WY/UT form of Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", arXiv:2406.06484, §3, with the gate of the Gated DeltaNet
paper, §3.3). Within a chunk of C tokens, let c_i = Σ_{j≤i} g_j (the decay's log summed from
the chunk's start) and Γ_ij = exp(c_i − c_j) for j ≤ i. Unrolling the update,

    M_i = e^{c_i} M_0 + Σ_{j≤i} Γ_ij k_j u_jᵀ,

and putting it into u_i gives the C × C lower-triangular system (I + A) U = β V − (β e^{c} K) M_0
with A_ij = β_i Γ_ij k_iᵀk_j for j < i. Its solution is U = W_v − W_k M_0, where
W_v = (I + A)⁻¹ diag(β) V and W_k = (I + A)⁻¹ diag(β e^{c}) K: two triangular solves. Then

    O = diag(e^{c}) Q M_0 + ((Q Kᵀ) ⊙ Γ ⊙ [j ≤ i]) U,
    M_C = e^{c_C} M_0 + (diag(e^{c_C − c}) K)ᵀ U,

so a chunk costs O(C² (d_k + d_v) + C d_k d_v) and the chunks run in sequence, carrying M. The
chunk's step is affine in the state it starts from: M_C = T M_0 + B with
T = e^{c_C} I − K̃ᵀ W_k and B = K̃ᵀ W_v (K̃ = diag(e^{c_C − c}) K), which context parallel uses
to hand each rank its true starting state (`sequence_transition` composes them over a
rank's tokens).

Every exponent above is ≤ 0 (g ≤ 0), so nothing overflows; the arithmetic is fp32 for bf16,
fp16 and fp32 inputs (fp64 for fp64 ones: `wide`), and the output comes back in the inputs'
dtype. q and k arrive L2-normalized and q scaled by
1/√d_k (the layer's job, `titanlab.models.common.linear_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens per chunk (flash-linear-attention's and Hugging Face's default)."""


def _heads_first(q, k, v, g, beta):
    """(bs, S, H, ·) inputs → (bs, H, S, ·) float32, key heads repeated to the value heads
    (each key head serves H_v / H_k consecutive value heads, Hugging Face's grouping)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # by index: repeat_interleave's backward breaks under AOTAutograd (a view)
        heads = torch.arange(k.shape[2], device=k.device).repeat_interleave(rep)
        q, k = q.index_select(2, heads), k.index_select(2, heads)
    dtype = wide(v.dtype)
    return [t.transpose(1, 2).to(dtype) for t in (q, k, v, g, beta)]


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rule computes in: float32 for bf16/fp16/fp32 inputs, float64 for float64
    ones (the exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token.

    Args:
        q, k: (bs, S, H_k, d_k); v: (bs, S, H_v, d_v), H_v a multiple of H_k.
        g: (bs, S, H_v) log decay (≤ 0); beta: (bs, S, H_v) write strength.
        state: (bs, H_v, d_k, d_v) float32 starting state, or None (zeros).
    Returns:
        (out (bs, S, H_v, d_v) in v's dtype, the final state (bs, H_v, d_k, d_v) float32).
    """
    qf, kf, vf, gf, bf = _heads_first(q, k, v, g, beta)
    bs, heads, seq, dk = kf.shape
    m = state.to(kf.dtype) if state is not None else kf.new_zeros(bs, heads, dk, vf.shape[-1])
    outs = []
    for t in range(seq):
        m = m * gf[:, :, t, None, None].exp()
        u = bf[:, :, t, None] * (vf[:, :, t] - (m * kf[:, :, t, :, None]).sum(-2))
        m = m + kf[:, :, t, :, None] * u[:, :, None, :]
        outs.append((m * qf[:, :, t, :, None]).sum(-2))
    out = torch.stack(outs, dim=2) if outs else vf.new_zeros(bs, heads, 0, vf.shape[-1])
    return out.transpose(1, 2).to(v.dtype), m


def _chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """(bs, H, S, ·) or (bs, H, S) padded at the end to whole chunks → (bs, H, n, C, ·)."""
    pad = -t.shape[2] % chunk
    if t.dim() == 4:
        t = F.pad(t, (0, 0, 0, pad))
        return t.reshape(t.shape[0], t.shape[1], -1, chunk, t.shape[-1])
    t = F.pad(t, (0, pad))
    return t.reshape(t.shape[0], t.shape[1], -1, chunk)


def _chunk_terms(kc, vc, gc, bc, starts=None):
    """Per chunk: (e^{c}, Γ masked to j ≤ i, W_v, W_k, K̃, e^{c_C}) of the module docstring,
    each (bs, H, n, C, ·) (the last (bs, H, n)); padded tokens have g = 0 and β = 0, so they
    write nothing. `starts` (bs, 1, n, C) bool marks the tokens where a document starts: the
    state is forgotten there (α = 0), so every term that carries a token's write, or the
    chunk's starting state, past a start is zero (`documents`)."""
    chunk = kc.shape[3]
    c = gc.cumsum(-1)  # (bs, H, n, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=kc.device).tril()
    gamma = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    decay, tail, end = c.exp(), (c[..., -1:] - c).exp(), c[..., -1].exp()
    if starts is not None:
        gamma, decay, tail, end = documents(starts, gamma, decay, tail, end)
    a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * gamma).tril(-1)
    eye = torch.eye(chunk, dtype=kc.dtype, device=kc.device)
    system = eye + a  # unit lower-triangular
    w_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        system, (bc * decay)[..., None] * kc, upper=False, unitriangular=True
    )
    k_tail = tail[..., None] * kc  # K̃: each key decayed to the chunk's end
    return decay, gamma, w_v, w_k, k_tail, end


def documents(starts, gamma, decay, tail, end):
    """The chunk terms of packed documents. A start at token r sets α_r = 0: M_r = k_r u_rᵀ,
    nothing of M_{r−1} survives. With s_i the number of starts at tokens ≤ i of the chunk,
    token j's write reaches token i (j ≤ i) iff s_i = s_j (Γ_ij), the chunk's starting state
    reaches token i iff s_i = 0 (e^{c_i}), and token j's write reaches the chunk's end iff
    s_j = s_C (K̃), its starting state iff s_C = 0 (e^{c_C}): each term times that 0/1."""
    s = starts.cumsum(-1)  # (bs, 1, n, C)
    gamma = gamma * (s[..., :, None] == s[..., None, :])
    return gamma, decay * (s == 0), tail * (s == s[..., -1:]), end * (s[..., -1] == 0)


def _starts(starts: torch.Tensor | None, chunk: int) -> torch.Tensor | None:
    """(bs, S) bool document starts → (bs, 1, n, C), padding no start."""
    return None if starts is None else _chunks(starts[:, None].to(torch.int64), chunk).bool()


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in chunks of `chunk` tokens (module docstring); the same arguments and returns
    as `recurrent`, equal to it within fp32 rounding. Any S (the last chunk is padded with
    tokens that neither decay nor write). `starts` (bs, S) bool: packed documents, each token
    marked True where a document starts, the state forgotten there (`documents`): each
    document runs as if alone."""
    qf, kf, vf, gf, bf = _heads_first(q, k, v, g, beta)
    bs, heads, seq, dk = kf.shape
    dv = vf.shape[-1]
    qc, kc, vc, gc, bc = (_chunks(t, chunk) for t in (qf, kf, vf, gf, bf))
    decay, gamma, w_v, w_k, k_tail, end = _chunk_terms(kc, vc, gc, bc, _starts(starts, chunk))
    scores = (qc @ kc.transpose(-1, -2)) * gamma  # (bs, H, n, C, C), zero above the diagonal
    q_decayed = decay[..., None] * qc
    m = state.to(kf.dtype) if state is not None else kf.new_zeros(bs, heads, dk, dv)
    m = m.reshape(bs * heads, dk, dv)
    outs = []
    # The loop runs on (bs·H, ·, ·) matrices with fused multiply-adds (baddbmm): five kernels a
    # chunk, where 4-D matmuls and separate adds dispatched about a hundred (the dry run's fake
    # tensors paid for each). One unbind per tensor, not an index per chunk: an index's
    # backward writes its chunk into a zero tensor of the whole sequence, which made the step
    # quadratic in the chunks.
    ends, w_v, w_k, q_decayed, scores, k_tail = (
        _per_chunk(t) for t in (end[..., None, None], w_v, w_k, q_decayed, scores,
                                 k_tail.transpose(-1, -2))
    )  # fmt: skip
    for wv_i, wk_i, qd_i, scores_i, kt_i, end_i in zip(
        w_v, w_k, q_decayed, scores, k_tail, ends, strict=True
    ):
        u = torch.baddbmm(wv_i, wk_i, m, alpha=-1)  # U = W_v − W_k M_0
        outs.append(torch.baddbmm(torch.bmm(scores_i, u), qd_i, m))
        m = torch.baddbmm(end_i * m, kt_i, u)
    m = m.reshape(bs, heads, dk, dv)
    if not outs:
        return vf.new_zeros(bs, 0, heads, dv).to(v.dtype), m
    out = torch.stack(outs, dim=1).reshape(bs, heads, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).to(v.dtype), m


def _per_chunk(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(bs, H, n, ·, ·) → n tensors (bs·H, ·, ·), one per chunk (views)."""
    return t.flatten(0, 1).unbind(1)


def sequence_transition(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map a whole sequence applies to the state it starts from: (T (bs, H_v, d_k,
    d_k), B (bs, H_v, d_k, d_v)) float32 with final state = T @ M_0 + B, for k (bs, S, H_k,
    d_k), v (bs, S, H_v, d_v), g and beta (bs, S, H_v). Each chunk's map (module docstring:
    T_i = e^{c_C} I − K̃ᵀ W_k, B_i = K̃ᵀ W_v) composed in order, (T, B) ← (T_i T, T_i B + B_i),
    so memory stays O(C²) per chunk whatever S."""
    _, kf, vf, gf, bf = _heads_first(k, k, v, g, beta)
    kc, vc, gc, bc = (_chunks(t, chunk) for t in (kf, vf, gf, bf))
    _, _, w_v, w_k, k_tail, end = _chunk_terms(kc, vc, gc, bc)
    bs, heads, dk, dv = kf.shape[0], kf.shape[1], kf.shape[-1], vf.shape[-1]
    eye = torch.eye(dk, dtype=kf.dtype, device=kf.device)
    t = eye.expand(bs * heads, dk, dk)
    b = kf.new_zeros(bs * heads, dk, dv)
    parts = zip(*(_per_chunk(x) for x in (k_tail.transpose(-1, -2), w_k, w_v,
                                          end[..., None, None])), strict=True)  # fmt: skip
    for kt, wk_i, wv_i, end_i in parts:  # (bs·H, ·, ·) matrices, as in `chunked`
        t_i = torch.baddbmm(end_i * eye, kt, wk_i, alpha=-1)
        t, b = torch.bmm(t_i, t), torch.baddbmm(torch.bmm(kt, wv_i), t_i, b)
    t, b = t.reshape(bs, heads, dk, dk), b.reshape(bs, heads, dk, dv)
    return t, b
