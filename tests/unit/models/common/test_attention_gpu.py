"""On a CUDA GPU, titanlab's attention in bf16 runs SDPA's flash backend (not the math fallback),
eager and compiled, and matches a float64 CPU reference (skipped without CUDA)."""

import copy

import pytest
import torch

from titanlab.models.common.attention import Attention
from titanlab.models.common.rope import precompute_rope_cos_sin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def sdpa_ops(fn) -> set[str]:
    """Names of the SDPA operators `fn()` runs (forward and backward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_bf16_attention_selects_flash_and_matches_float64(compiled):
    torch.manual_seed(0)
    ref = Attention(dim=512, n_heads=8, kv_heads=2, head_dim=64, qk_norm_eps=None).double()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    attn = copy.deepcopy(ref).to("cuda", torch.bfloat16)
    cos, sin = precompute_rope_cos_sin(64, 1024, 10000.0, None)
    x = torch.randn(2, 1024, 512, dtype=torch.float64)
    expected = ref(x, cos.double(), sin.double())

    xg = x.to("cuda", torch.bfloat16).requires_grad_()
    run = torch.compile(attn, fullgraph=True) if compiled else attn
    run(xg, cos.cuda(), sin.cuda())  # warm-up (compiles)
    out: list[torch.Tensor] = []

    def step():
        y = run(xg, cos.cuda(), sin.cuda())
        y.float().square().mean().backward()
        out.append(y)

    ops = sdpa_ops(step)
    assert any("_scaled_dot_product_flash_attention" in o for o in ops), ops
    assert not any("math" in o for o in ops), ops
    got = out[0].double().cpu()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel  # bf16 operands: 1e-3..1e-2
