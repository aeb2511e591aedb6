"""RoPE and attention against straightforward reference implementations."""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlab.models.common.attention import Attention as _Attention
from titanlab.models.common.rope import (
    RopeScaling,
    apply_rotary_emb,
    precompute_rope_cos_sin,
    rope_frequencies,
)
from titanlab.models.llama3 import TransformerModelArgs


def Attention(args: TransformerModelArgs) -> _Attention:
    """Llama's attention (no q/k norm) of `args`."""
    return _Attention(args.dim, args.n_heads, args.kv_heads, args.head_dim, None)


SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def reference_scaled_freq(freq: float, s: RopeScaling) -> float:
    """Llama 3.1 rule, scalar Python math."""
    wavelen = 2 * math.pi / freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    if wavelen < high_wavelen:
        return freq
    if wavelen > low_wavelen:
        return freq / s.factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    return (1 - smooth) * freq / s.factor + smooth * freq


def reference_rope_complex(x, freqs, seq):
    """Meta's reference: freqs_cis = polar(1, t*f); x viewed as complex pairs."""
    angles = torch.outer(torch.arange(seq).float(), freqs)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def test_scaled_frequencies_match_python_rule():
    head_dim, theta = 32, 500000.0
    freqs = rope_frequencies(head_dim, theta, SCALING)
    plain = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    expected = [reference_scaled_freq(f, SCALING) for f in plain]
    # head_dim 32 / theta 5e5 covers all three branches: i<=7 kept, i=8 blended, i>=9 divided.
    assert expected[0] == plain[0] and expected[15] == plain[15] / 8
    assert plain[8] / 8 < expected[8] < plain[8]
    for i in (0, 5, 7, 8, 9, 15):
        assert math.isclose(freqs[i].item(), expected[i], rel_tol=1e-5), i
    # 32x scaling (Llama 3.2) moves only the low frequencies.
    f32 = rope_frequencies(head_dim, theta, RopeScaling(factor=32.0))
    assert math.isclose(f32[15].item(), plain[15] / 32, rel_tol=1e-5)
    assert math.isclose(f32[0].item(), plain[0], rel_tol=1e-6)


def test_cos_sin_tables():
    cos, sin = precompute_rope_cos_sin(16, 10, 10000.0, None)
    assert cos.shape == sin.shape == (10, 8) and cos.dtype == torch.float32
    freqs = rope_frequencies(16, 10000.0, None)
    torch.testing.assert_close(sin[3], torch.sin(3 * freqs))
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))


def test_apply_rotary_emb_matches_complex_reference():
    torch.manual_seed(0)
    bs, seq, heads, kv, head_dim = 2, 7, 4, 2, 16
    xq, xk = torch.randn(bs, seq, heads, head_dim), torch.randn(bs, seq, kv, head_dim)
    cos, sin = precompute_rope_cos_sin(head_dim, seq, 500000.0, SCALING)
    freqs = rope_frequencies(head_dim, 500000.0, SCALING)
    q, k = apply_rotary_emb(xq, xk, cos, sin)
    torch.testing.assert_close(q, reference_rope_complex(xq, freqs, seq), atol=1e-6, rtol=0)
    torch.testing.assert_close(k, reference_rope_complex(xk, freqs, seq), atol=1e-6, rtol=0)
    assert torch.equal(q[:, 0], xq[:, 0]) and torch.equal(k[:, 0], xk[:, 0])  # position 0
    qb, _ = apply_rotary_emb(xq.bfloat16(), xk.bfloat16(), cos, sin)
    assert qb.dtype == torch.bfloat16


class _KernelLog(TorchDispatchMode):
    """The aten ops that write memory (views left out), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops.append(func.__name__)
        return out


def test_eager_rotation_is_one_complex_product_each_way():
    # torchtitan's three passes (cast, complex product, cast back): the real-pair form took ten
    # eager kernels per tensor, the one row where the ledger priced titanlab behind torchtitan.
    xq = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = precompute_rope_cos_sin(16, 5, 10000.0, None)
    log = _KernelLog()
    with log:
        q, _ = apply_rotary_emb(xq, xq.detach(), cos, sin)
        q.float().sum().backward()
    products = [op for op in log.ops if op.startswith("mul")]
    assert len(products) == 3, log.ops  # q and k forward, q backward (the real form: 10)
    assert len(log.ops) <= 16, log.ops  # with the casts, the sum and its backward (real: 35)


def test_compiled_rotation_matches_the_complex_product():
    # Under torch.compile the same product runs in real pairs (Inductor has no complex codegen).
    torch.manual_seed(0)
    xq, xk = torch.randn(2, 7, 4, 16, requires_grad=True), torch.randn(2, 7, 2, 16)
    cos, sin = precompute_rope_cos_sin(16, 7, 500000.0, SCALING)
    eager_q, eager_k = apply_rotary_emb(xq, xk, cos, sin)
    (eager_grad,) = torch.autograd.grad(eager_q.square().sum(), xq)
    compiled_q, compiled_k = torch.compile(apply_rotary_emb, backend="aot_eager")(xq, xk, cos, sin)
    (compiled_grad,) = torch.autograd.grad(compiled_q.square().sum(), xq)
    torch.testing.assert_close(compiled_q, eager_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(compiled_k, eager_k, atol=1e-6, rtol=0)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-5, rtol=0)


def small_args(**kw):
    base = dict(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=64,
        multiple_of=16,
        max_seq_len=16,
        rope_scaling=SCALING,
    )
    return TransformerModelArgs(**{**base, **kw})


def naive_attention(attn: Attention, x, cos, sin, freqs):
    bs, seq, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bs, seq, -1, hd)
    k = (x @ attn.wk.weight.T).view(bs, seq, -1, hd)
    v = (x @ attn.wv.weight.T).view(bs, seq, -1, hd)
    q, k = reference_rope_complex(q, freqs, seq), reference_rope_complex(k, freqs, seq)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seq, hd)
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
    return (probs @ v).transpose(1, 2).reshape(bs, seq, -1) @ attn.wo.weight.T


def test_attention_matches_naive_gqa_and_is_causal():
    torch.manual_seed(0)
    args = small_args()
    attn = Attention(args)
    for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
        torch.nn.init.normal_(lin.weight, std=0.1)
    seq = 9
    x = torch.randn(2, seq, args.dim)
    cos, sin = precompute_rope_cos_sin(args.head_dim, seq, args.rope_theta, SCALING)
    freqs = rope_frequencies(args.head_dim, args.rope_theta, SCALING)
    out = attn(x, cos, sin)
    torch.testing.assert_close(out, naive_attention(attn, x, cos, sin, freqs), atol=1e-5, rtol=0)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, seq - 5, args.dim)
    out2 = attn(x2, cos, sin)
    torch.testing.assert_close(out2[:, :5], out[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(out2[:, 5:], out[:, 5:])


def test_attention_runs_on_local_heads_like_tensor_parallel():
    """Column-sharded wq/wk/wv + row-sharded wo (2 'ranks'): partial outputs sum to the full."""
    torch.manual_seed(0)
    args = small_args()
    full = Attention(args)
    x = torch.randn(1, 6, args.dim)
    cos, sin = precompute_rope_cos_sin(args.head_dim, 6, args.rope_theta, SCALING)
    total = torch.zeros(1, 6, args.dim)
    for rank in range(2):
        shard = Attention(args)  # 4 local q heads, 1 local kv head after the swap below
        for name in ("wq", "wk", "wv"):
            w = getattr(full, name).weight.chunk(2, dim=0)[rank]  # column-wise shard
            setattr(shard, name, torch.nn.Linear(args.dim, w.shape[0], bias=False))
            getattr(shard, name).weight.data.copy_(w)
        shard.wo = torch.nn.Linear(args.dim // 2, args.dim, bias=False)  # row-wise shard
        shard.wo.weight.data.copy_(full.wo.weight.chunk(2, dim=1)[rank])
        total += shard(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), atol=1e-5, rtol=0)
