"""The ledger's gates at real shapes (docs/ledger.md): Llama 3 8B's blocks and head at seq_len
8192 on FSDP 8, bf16 and compiled as train_configs/llama_8b.toml ships it, on the H100 profile,
with 2 of its 32 blocks (every op has its real shape; 30 fewer blocks make the head's share of
the GEMMs larger, so an fp32 head shows more, not less). The fp32 share of GEMM FLOPs stays
under 1% in bf16 and float8 runs, and the defect of 2026-11-27 (the fused loss's weight
gradient as fp32 GEMMs), put back, fails it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from titanlab.ledger.gates import MAX_FP32_GEMM_SHARE, fp32_gemm_share
from titanlab.ledger.run import build_ledger
from titanlab.models.registry import get_family

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def llama3_8b_blocks(folder, n_layers: int = 2) -> list[str]:
    """Options for Llama 3 8B's dims with `n_layers` blocks (a config.json in `folder`)."""
    family = get_family("llama3")
    args = dataclasses.replace(family.flavors["8B"], n_layers=n_layers)
    path = os.path.join(folder, "config.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(family.hf.to_config(args, torch.bfloat16, 131072, None, None), f)
    return ["--model.flavor", "hf", "--model.hf_config", path]


def ledger_of(tmp_path, *extra: str):
    config = os.path.join(REPO, "train_configs", "llama_8b.toml")
    return build_ledger(
        ["--job.config_file", config, *llama3_8b_blocks(str(tmp_path)), *extra], "h100"
    )


@pytest.mark.parametrize("precision", ["bf16", "float8"])
def test_no_fp32_gemm_beyond_one_percent(tmp_path, precision):
    extra = ["--float8.enable", "true"] if precision == "float8" else []
    ledger = ledger_of(tmp_path, *extra)
    share, by_module = fp32_gemm_share(ledger)
    print(f"{precision}: fp32 share of GEMM FLOPs {share:.4%} {by_module}")
    assert share <= MAX_FP32_GEMM_SHARE, by_module
    if precision == "float8":  # the GPU's float8 GEMMs, not torchao's emulation in bf16
        assert any(op.op == "aten._scaled_mm.default" for op in ledger.ops)
    gemm = sum(op.flops for op in ledger.ops if op.kind == "gemm")
    # forward + backward of 2 blocks and the head: 6 × their parameters × 8192 tokens, ±5%
    # (plus attention's score GEMMs: SDPA's own op)
    params = 2 * (4 * 4096 * 4096 // 4 * 2 + 4096 * 4096 * 2 + 3 * 4096 * 14336) + 4096 * 128256
    assert gemm == pytest.approx(6 * params * 8192, rel=0.05)


def test_the_fp32_weight_gradient_of_2026_11_27_fails_the_gate(tmp_path, monkeypatch):
    import titanlab.components.fused_ce as fused_ce

    def fp32_everywhere(acc, a, b):  # the accumulation before the fix
        acc.addmm_(a.float(), b.float())

    monkeypatch.setattr(fused_ce, "_add_product", fp32_everywhere)
    share, by_module = fp32_gemm_share(ledger_of(tmp_path))
    print(f"the defect put back: fp32 share {share:.2%} {by_module}")
    assert share > MAX_FP32_GEMM_SHARE and "output" in by_module
