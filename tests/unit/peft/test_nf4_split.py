"""NF4 tensor-parallel shards (`titanlab.peft.nf4_split`): every shard of every valid split
dequantizes bitwise to the same slice of the whole weight, the split and FSDP checks name what
does not fit, and the TP split dims come from the plan `apply_tp` applies."""

import dataclasses
import itertools

import pytest
import torch

from titanlab.distributed.tensor_parallel.one_d import linear_split_dims
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.qwen3_moe import qwen3_moe_flavors
from titanlab.models.registry import build_model
from titanlab.peft.nf4_split import (
    nf4_linear,
    nf4_shard,
    shard_layout,
    shard_problem,
    split_problem,
)

to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
# Rows × columns of 64·256-weight multiples: blocks that straddle rows, scaler blocks that
# straddle rows, shards that cut blocks in half.
SHAPES = [(256, 256), (704, 256), (256, 704), (512, 448), (64, 768), (4096 // 8, 14336 // 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_shard_dequantizes_to_the_whole_weights_slice(shape, dtype):
    weight = to_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    whole = weight.get_original_weight()
    checked = 0
    for dim, parts in itertools.product((0, 1), (2, 4, 8)):
        if split_problem("w", shape, dim, parts):
            continue
        for index, want in enumerate(whole.chunk(parts, dim=dim)):
            shard = nf4_shard(weight, dim, index, parts)
            assert shard.shape == want.shape
            assert torch.equal(shard.get_original_weight(), want), (dim, parts, index)
            checked += 1
    assert checked >= 2 * (2 + 4 + 8) - 8  # most splits are valid


def test_a_shard_is_about_as_small_as_its_share():
    weight = to_nf4(torch.randn(512, 1792))
    whole = sum(getattr(weight, n).numel() for n in ("quantized_data", "quantized_scalers"))
    shard = nf4_shard(weight, 1, 0, 4)
    part = sum(getattr(shard, n).numel() for n in ("quantized_data", "quantized_scalers"))
    assert part == whole // 4
    block, scaler_block = shard_layout((512, 1792), 1, 4)
    assert (block, shard.quantization_factor.numel()) == (64, shard.n_blocks // scaler_block)


def test_the_checks_name_the_weight_and_what_fails():
    assert split_problem("w", (256, 256), 1, 2) is None
    assert split_problem("w", (256, 6), 1, 4) == (
        "w (256×6) cannot be stored as NF4 over 4 tensor-parallel ranks: its columns must split "
        "into equal, even counts of weights"
    )
    assert shard_problem("w", (256, 256), 2, tp=2, tp_dim=1) is None
    assert shard_problem("wk", (128, 256), 2, tp=2, tp_dim=0) == (
        "wk (128×256) cannot be stored as NF4 over 2 FSDP shards of each of its 2 "
        "tensor-parallel shards: its rows must split evenly and each shard must hold a multiple "
        "of 16384 weights (64·256)"
    )
    assert shard_problem("w", (96, 256), 1) == (
        "w (96×256) cannot be stored as NF4: it must be 2-D and hold a multiple of 16384 "
        "weights (64·256)"
    )


def test_nf4_linear_on_a_plain_weight_is_the_dequantized_linear_and_saves_no_copy():
    weight = to_nf4(torch.randn(256, 256))
    x = torch.randn(2, 3, 256, requires_grad=True)
    y = nf4_linear(x, weight)
    torch.testing.assert_close(y, x @ weight.get_original_weight().T, rtol=0, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 3, 256) @ weight.get_original_weight())


def test_split_dims_follow_the_tp_plan():
    with torch.device("meta"):
        dense = build_model(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512))
        moe = build_model(dataclasses.replace(qwen3_moe_flavors["debugmodel"], vocab_size=512))
    dims = linear_split_dims(dense)
    assert dims["output"] == 0
    assert {k.split(".", 2)[2]: v for k, v in dims.items() if k.startswith("layers.0.")} == {
        "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
        "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
    }  # fmt: skip
    # MoE experts and the router are not tensor-parallel.
    assert not [k for k in linear_split_dims(moe) if "feed_forward" in k]


def test_split_dims_name_the_mtp_blocks_as_the_plan_splits_them():
    """DeepSeek-V3's MTP depth block gets the block plan under TP (`_apply_mtp_tp`), so its
    Linear layers are named like a layer's (QLoRA quantizes each whole, TP keeps the shard)."""
    from titanlab.models.deepseek_v3 import deepseek_v3_flavors

    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=512)
    with torch.device("meta"):
        model = build_model(args)
    dims = linear_split_dims(model)
    last = str(args.n_layers - 1)  # an MoE layer, like the depth's block
    layer = {k.split(".", 2)[2]: v for k, v in dims.items() if k.startswith(f"layers.{last}.")}
    depth = {k[len("mtp.0.block.") :]: v for k, v in dims.items() if k.startswith("mtp.0.block.")}
    assert depth == layer and depth["attention.wo"] == 1
