"""LoRA under torch.compile: a block with adapters on every Linear compiles to one graph
(fullgraph, no break per adapter), gives the eager outputs and adapter gradients, and leaves
the frozen base without gradients; an adapter on an NF4 base (QLoRA) is one graph too."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from titanlab.config.peft import Peft
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.peft.lora import apply_lora, init_adapters

TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def test_a_block_with_adapters_is_one_graph_with_the_eager_gradients():
    torch._dynamo.reset()
    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel_tiny"),
                               vocab_size=512, max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    cfg = Peft(method="lora", rank=4, alpha=8.0, target_modules=TARGETS)
    assert apply_lora(model, cfg) == len(TARGETS) * args.n_layers
    init_adapters([model], seed=0)
    for name, p in model.named_parameters():  # B is zero at start: give the adapters a signal
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.02)
    block = model.layers["0"]
    x = torch.randn(2, 16, args.dim)
    call = (x, model.rope_cos[:16], model.rope_sin[:16])

    def run(fn):
        block.zero_grad(set_to_none=True)
        out = fn(*call)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
        return out.detach(), grads

    want, want_grads = run(block)
    counter = CompileCounterWithBackend("aot_eager")
    got, got_grads = run(torch.compile(block, fullgraph=True, backend=counter))
    assert counter.frame_count == 1  # one graph for the whole block, adapters included
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert sorted(got_grads) == sorted(want_grads)
    assert all("lora_" in n for n in got_grads) and len(got_grads) == 2 * len(TARGETS)
    for n in want_grads:
        assert torch.allclose(got_grads[n], want_grads[n], atol=1e-6, rtol=0), n


def test_an_adapter_on_an_nf4_base_compiles_to_one_graph():
    """QLoRA: the NF4 base (torchao's `linear_nf4`: dequantize, then the matmul) and its
    adapter trace into one graph with the eager output and adapter gradients."""
    from torchao.quantization import to_nf4

    from titanlab.peft.lora import LoRALinear

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LoRALinear(256, 128, rank=4, alpha=8.0, dropout=0.0)
    layer.weight = torch.nn.Parameter(to_nf4(0.02 * torch.randn(128, 256)), requires_grad=False)
    torch.nn.init.normal_(layer.lora_b.weight, std=0.02)
    x = torch.randn(4, 256, requires_grad=True)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = fn(x)
        out.square().sum().backward()
        return out.detach(), layer.lora_a.weight.grad.clone(), x.grad.clone()

    want = run(layer)
    counter = CompileCounterWithBackend("aot_eager")
    got = run(torch.compile(layer, fullgraph=True, backend=counter))
    assert counter.frame_count == 1 and layer.weight.grad is None
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=0)
