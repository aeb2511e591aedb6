"""On a CUDA GPU, titanlab's attention in bf16 runs a flash-attention kernel (not the math or
memory-efficient fallback), eager and compiled, and matches a float64 CPU reference (skipped
without CUDA). On Hopper, torch prefers SDPA's cuDNN backend, whose kernels are cuDNN's flash
attention; with that backend off, torch's own flash kernel (FlashAttention-2) runs."""

import copy

import torch._functorch.config
import torch._inductor.config

import pytest
import torch

from titanlab.models.common.attention import Attention
from titanlab.models.common.rope import precompute_rope_cos_sin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FLASH_OPS = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
}


def profiled(fn) -> tuple[set[str], set[str]]:
    """(SDPA operators, CUDA kernels) that `fn()` runs, forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}
    kernels = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return ops, kernels


@pytest.mark.parametrize("cudnn", [True, False], ids=["default", "cudnn-off"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_bf16_attention_runs_flash_and_matches_float64(compiled, cudnn):
    torch.manual_seed(0)
    ref = Attention(dim=512, n_heads=8, kv_heads=2, head_dim=64, qk_norm_eps=None).double()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    attn = copy.deepcopy(ref).to("cuda", torch.bfloat16)
    cos, sin = precompute_rope_cos_sin(64, 1024, 10000.0, None)
    x = torch.randn(2, 1024, 512, dtype=torch.float64)
    expected = ref(x, cos.double(), sin.double())

    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    # The SDPA backend flags are not part of torch.compile's on-disk cache keys: without this,
    # the cudnn-off case would reuse the graph compiled (with cuDNN attention) by the other.
    no_cache = (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    try:
        no_cache[0].__enter__(), no_cache[1].__enter__()
        torch._dynamo.reset()
        xg = x.to("cuda", torch.bfloat16).requires_grad_()
        run = torch.compile(attn, fullgraph=True) if compiled else attn
        run(xg, cos.cuda(), sin.cuda())  # warm-up (compiles)
        out: list[torch.Tensor] = []

        def step():
            y = run(xg, cos.cuda(), sin.cuda())
            y.float().square().mean().backward()
            out.append(y)

        ops, kernels = profiled(step)
    finally:
        no_cache[1].__exit__(None, None, None), no_cache[0].__exit__(None, None, None)
        torch.backends.cuda.enable_cudnn_sdp(was)
    forward = {o for o in ops if not o.endswith("_backward")}
    assert forward and forward <= FLASH_OPS, ops
    if not cudnn:
        assert forward == {"aten::_scaled_dot_product_flash_attention"}, ops
    assert any("flash" in k.lower() for k in kernels), sorted(kernels)[:20]
    got = out[0].double().cpu()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel  # bf16 operands: 1e-3..1e-2
