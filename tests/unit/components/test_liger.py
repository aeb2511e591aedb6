"""Liger kernels (`kernels.liger`): bad input is one line before launch (no package, no CUDA,
tensor parallel); the swaps keep every parameter and name and route RMSNorm, SwiGLU and the
fused loss through Liger's functions (checked on CPU against a stand-in package that computes
what Liger's kernels compute); on a CUDA GPU with liger-kernel installed, the model's logits,
loss and gradients match titanlab's own modules (skipped otherwise)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from titanlab.components import liger
from titanlab.components.fused_head import fused_targets, use_fused_loss
from titanlab.components.loss import cross_entropy_sum
from titanlab.config.errors import ConfigError
from titanlab.config.manager import build_config
from titanlab.models.registry import build_model, get_family, get_flavor

VOCAB = 512


def tiny(family: str = "llama3", flavor: str = "debugmodel_tiny"):
    args = dataclasses.replace(get_flavor(get_family(family), flavor), vocab_size=VOCAB,
                               max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


def test_without_the_package_or_without_cuda_is_one_line(monkeypatch):
    liger.check_liger(False, torch.device("cpu"))  # off: nothing checked
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        liger.check_liger(True, torch.device("cuda"))
    assert str(e.value).startswith("kernels.liger=true needs the liger-kernel package")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError) as e:
        liger.check_liger(True, torch.device("cpu"))
    assert "needs a CUDA GPU" in str(e.value) and "\n" not in str(e.value)


def test_under_tensor_parallel_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_config(["--kernels.liger", "true", "--parallelism.tensor_parallel_degree", "2"])
    assert str(e.value).startswith(
        "kernels.liger=true with parallelism.tensor_parallel_degree=2 is not supported"
    )


@pytest.fixture
def stand_in(monkeypatch) -> Counter:
    """A `liger_kernel` package whose functions compute what Liger's kernels compute (RMSNorm
    in the "llama" casting mode, silu(a) · b, the summed cross-entropy of x Wᵀ), counting calls."""
    calls: Counter = Counter()

    class RMSNormFunction:
        @staticmethod
        def apply(x, weight, eps, offset, casting_mode, in_place):
            calls["rms_norm"] += 1
            assert (offset, casting_mode, in_place) == (0.0, "llama", False)
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return normed.to(x.dtype) * weight

    class SiLUMulFunction:
        @staticmethod
        def apply(a, b):
            calls["silu_mul"] += 1
            return F.silu(a) * b

    class FusedLinearCrossEntropyLoss:
        def __init__(self, ignore_index: int, reduction: str) -> None:
            self.ignore_index, self.reduction = ignore_index, reduction

        def __call__(self, weight, x, target):
            calls["linear_cross_entropy"] += 1
            logits = F.linear(x, weight).float()
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index,
                                   reduction=self.reduction)  # fmt: skip

    package = types.ModuleType("liger_kernel")
    ops = types.ModuleType("liger_kernel.ops")
    ops.LigerRMSNormFunction, ops.LigerSiLUMulFunction = RMSNormFunction, SiLUMulFunction
    hf = types.ModuleType("liger_kernel.transformers")
    hf.LigerFusedLinearCrossEntropyLoss = FusedLinearCrossEntropyLoss
    for name, module in (("liger_kernel", package), ("liger_kernel.ops", ops),
                         ("liger_kernel.transformers", hf)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize(("family", "flavor"), [("llama3", "debugmodel_tiny"),
                                                ("qwen3", "debugmodel_deep")])  # fmt: skip
def test_the_swaps_keep_the_parameters_and_route_through_liger(stand_in, family, flavor):
    model = tiny(family, flavor)
    tokens = torch.randint(0, VOCAB, (2, 12))
    labels = torch.randint(0, VOCAB, (2, 12))
    labels[0, :3] = -100
    want_logits = model(tokens)
    want_loss = cross_entropy_sum(want_logits, labels)
    names = {n: p for n, p in model.named_parameters()}
    use_fused_loss(model, chunk_size=8)
    swapped = liger.apply_liger(model)
    layers = len(model.layers)
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)  # + q/k norms
    assert swapped == norms + layers + 1  # norms, feed-forwards, the head
    assert {n: p for n, p in model.named_parameters()} == names  # the same Parameters
    got_logits = model(tokens)
    assert stand_in == {"rms_norm": norms, "silu_mul": layers}
    with fused_targets(model, labels):
        got_loss = model(tokens)
    assert stand_in["linear_cross_entropy"] == 1
    assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=0)
    assert torch.allclose(got_loss, want_loss, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
    reason="needs a CUDA GPU and liger-kernel",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_liger_matches_titanlabs_modules(dtype):
    plain = tiny().to("cuda", dtype)
    fused = tiny().to("cuda", dtype)
    use_fused_loss(fused, chunk_size=16)
    liger.apply_liger(fused)
    tokens = torch.randint(0, VOCAB, (2, 24), device="cuda")
    labels = torch.randint(0, VOCAB, (2, 24), device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(fused(tokens).float(), plain(tokens).float(), atol=tol, rtol=tol)
    want = cross_entropy_sum(plain(tokens), labels)
    with fused_targets(fused, labels):
        got = fused(tokens)
    tokens_n = labels.numel()
    assert abs(got.item() - want.item()) / tokens_n < tol
    want.backward()
    got.backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad.float(), b.grad.float(), atol=10 * tol, rtol=10 * tol), name
