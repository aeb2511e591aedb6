"""The one place that picks the chunked gated delta rule's kernel, by the code path: on CUDA,
flash-linear-attention's Triton kernel (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`,
the `fla-core` / `flash-linear-attention` package, Yang et al.; the kernel Hugging Face's Qwen3.5
calls) when it is installed (`pip install titanlab[fla]`); on fake CPU tensors that take the
GPU's code path (the ledger), that kernel's priced stand-in (`delta_rule_stand_in`);
everywhere else titanlab's PyTorch `delta_rule.chunked`.

Both take q, k (bs, S, H_k, d_k) already L2-normalized, q scaled by 1/√d_k, v (bs, S, H_v,
d_v), g and beta (bs, S, H_v) float32 and a float32 state (bs, H_v, d_k, d_v) or None, and
return (out (bs, S, H_v, d_v) in v's dtype, the state after the sequence, float32).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from titanlab.config.device_path import device_type
from titanlab.models.common import delta_rule
from titanlab.models.common.delta_rule_stand_in import priced_chunked

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _import_fla() -> Rule | None:
    """flash-linear-attention's chunked kernel, or None when the package is not installed."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None
    return module.chunk_gated_delta_rule


FLA_RULE: Rule | None = _import_fla()
"""Looked up once, at import: `chunked_rule` runs inside compiled blocks, where an import
cannot be traced."""


def fla_chunked(
    kernel: Rule,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule.chunked`'s contract on flash-linear-attention's kernel: q and k in v's dtype
    (the kernel's inputs share one), already normalized and scaled (scale 1, no in-kernel L2
    norm), key heads as they are (the kernel lets each key head serve H_v / H_k value heads, as
    Hugging Face calls it)."""
    out, final = kernel(
        q.to(v.dtype), k.to(v.dtype), v, g=g.float(), beta=beta.to(v.dtype), scale=1.0,
        initial_state=None if state is None else state.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )  # fmt: skip
    return out.to(v.dtype), final.float()


def chunked_rule(x: torch.Tensor) -> Rule:
    """The chunked rule for tensors like `x` (module docstring): the fla kernel when the code
    path is CUDA, `x` really lives on a GPU and the package is installed; its priced stand-in
    (`delta_rule_stand_in.priced_chunked`) when the code path is CUDA and `x` is a CPU tensor
    (a GPU step priced on fake tensors); else PyTorch's."""
    kernel = FLA_RULE
    if device_type(x.device) == "cuda":
        if x.device.type != "cuda":
            return priced_chunked
        if kernel is not None:
            return lambda *args: fla_chunked(kernel, *args)
    return delta_rule.chunked
