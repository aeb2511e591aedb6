"""MXFP4 dequantization: hand-packed bytes give the exact values (low nibble first, scale bias
127); random gpt-oss-shaped tensors match transformers' `convert_moe_packed_tensors` and an
independent per-element reference bit for bit (fp32 and bf16), in any chunking; exactly
representable values survive quantize -> dequantize; bad shapes and dtypes raise one-line
`ValueError`s naming the tensor."""

import pytest
import torch

from titanlab.models.common.mxfp4 import (
    FP4_E2M1_VALUES,
    check_mxfp4,
    dequantize_gpt_oss_experts,
    dequantize_mxfp4,
)

NAME = "model.layers.0.mlp.experts.gate_up_proj"
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from +0.0, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def random_mxfp4(shape=(3, 8, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(115, 131, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Slow per-element dequantization in Python floats: (..., rows, G, 16) -> (..., rows, G*32)."""
    *lead, g, _ = blocks.shape
    flat_b, flat_s = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    vals = []
    for row, s in zip(flat_b, flat_s, strict=True):
        for byte in row:
            vals += [FP4_E2M1_VALUES[byte & 15] * 2.0 ** (s - 127)]
            vals += [FP4_E2M1_VALUES[byte >> 4] * 2.0 ** (s - 127)]
    return torch.tensor(vals, dtype=torch.float32).reshape(*lead, g * 32)


def test_hand_packed_bytes():
    # 0x21: low nibble 1 -> 0.5, high 2 -> 1.0; 0x10: 0.0, 0.5; 0x7F: -6.0, 6.0; 0x98: -0.0, -0.5
    row = [0x21, 0x10, 0x7F, 0x98] + [0x00] * 12
    base = torch.tensor([0.5, 1.0, 0.0, 0.5, -6.0, 6.0, -0.0, -0.5] + [0.0] * 24)
    blocks = torch.tensor([[row]] * 3, dtype=torch.uint8)  # (rows=3, G=1, 16)
    scales = torch.tensor([[127], [128], [125]], dtype=torch.uint8)  # x1, x2, x0.25
    want = torch.stack([base, base * 2, base * 0.25])
    assert same_bits(dequantize_mxfp4(blocks, scales), want)
    assert same_bits(dequantize_mxfp4(blocks, scales, torch.bfloat16), want.bfloat16())
    assert dequantize_mxfp4(blocks, scales)[2, :4].tolist() == [0.125, 0.25, 0.0, 0.125]
    # gpt-oss layout: (E=1, rows=3, G=1, 16) -> (1, 32, 3), the transpose
    experts = dequantize_gpt_oss_experts(blocks[None], scales[None])
    assert experts.shape == (1, 32, 3) and experts.is_contiguous()
    assert same_bits(experts[0], want.T.contiguous())


def test_scale_extremes():
    blocks = torch.full((3, 1, 16), 0xF9, dtype=torch.uint8)  # low 9 -> -0.5, high F -> -6.0
    out = dequantize_mxfp4(blocks, torch.tensor([[0], [254], [255]], dtype=torch.uint8))
    assert out[0, :2].tolist() == [-(2.0**-128), -6 * 2.0**-127]  # subnormal in fp32, exact
    assert out[1, :2].tolist() == [-(2.0**126), float("-inf")]  # 6 * 2**127 is past fp32
    assert out[2].isnan().all()  # E8M0 0xFF is NaN: the whole block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_and_reference(dtype):
    blocks, scales = random_mxfp4()  # (E=3, rows=8, G=4, 16)
    ref = reference(blocks, scales)  # (3, 8, 128)
    assert same_bits(dequantize_mxfp4(blocks, scales, dtype), ref.to(dtype))
    ours = dequantize_gpt_oss_experts(blocks, scales, dtype)
    assert ours.shape == (3, 128, 8) and ours.is_contiguous()
    assert same_bits(ours, ref.transpose(1, 2).contiguous().to(dtype))
    # transformers' own loader path runs on CPU (a LUT gather then torch.ldexp per chunk)
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    theirs = hf.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert same_bits(ours, theirs)


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 5, 1000])
def test_chunking(rows_per_chunk):
    blocks, scales = random_mxfp4((3, 8, 4), seed=1)
    whole = dequantize_mxfp4(blocks, scales)
    chunked = dequantize_mxfp4(blocks, scales, rows_per_chunk=rows_per_chunk)
    assert same_bits(chunked, whole)
    experts = dequantize_gpt_oss_experts(blocks, scales, rows_per_chunk=rows_per_chunk)
    assert same_bits(experts, whole.transpose(1, 2).contiguous())


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiny MXFP4 quantizer for values already on the grid: per block of 32 the scale is
    floor(log2(amax)) - 2 (E2M1's top exponent), the codes are table look-ups."""
    *lead, k = x.shape
    xb = x.reshape(*lead, k // 32, 32)
    exp = torch.floor(torch.log2(xb.abs().amax(-1))).to(torch.int32) - 2
    q = xb / torch.ldexp(torch.ones(exp.shape), exp)[..., None]
    table = torch.tensor(FP4_E2M1_VALUES)
    hit = (q[..., None] == table) & (q[..., None].signbit() == table.signbit())
    assert (hit.sum(-1) == 1).all(), "value not on the FP4 grid"
    codes = hit.to(torch.uint8).argmax(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


def test_round_trip():
    g = torch.Generator().manual_seed(2)
    e, rows, groups = 2, 5, 3
    codes = torch.randint(0, 16, (e, rows, groups, 32), generator=g)
    codes[..., 7] = 7  # +6.0 in each block so that the block's amax fixes its scale
    codes[..., 11] = 14  # -4.0
    exp = torch.randint(-20, 20, (e, rows, groups, 1), generator=g)
    x = torch.ldexp(torch.tensor(FP4_E2M1_VALUES)[codes], exp).reshape(e, rows, groups * 32)
    blocks, scales = quantize(x)
    assert blocks.shape == (e, rows, groups, 16) and scales.shape == (e, rows, groups)
    assert same_bits(dequantize_mxfp4(blocks, scales), x)
    assert same_bits(dequantize_mxfp4(blocks, scales, torch.bfloat16), x.bfloat16())
    assert same_bits(dequantize_gpt_oss_experts(blocks, scales), x.transpose(1, 2).contiguous())


@pytest.mark.parametrize(
    "blocks_shape, scales_shape, words",
    [
        ((4, 8, 15), (4, 8), "(4, 8, 15)"),  # last dim not 16
        ((4, 8, 16), (4, 7), "(4, 8)"),  # scales not blocks' shape less its last dim
        ((4, 8, 16), (4, 8, 1), "(4, 8)"),
        ((16,), (), "(16,)"),  # fewer than 2 dims
    ],
)
def test_check_mxfp4_errors(blocks_shape, scales_shape, words):
    with pytest.raises(ValueError) as err:
        check_mxfp4(NAME, blocks_shape, scales_shape)
    msg = str(err.value)
    assert "\n" not in msg and NAME in msg and words in msg
    check_mxfp4(NAME, (4, 8, 16), (4, 8))  # valid: no error
    check_mxfp4(NAME, torch.Size([2, 4, 8, 16]), torch.Size([2, 4, 8]))


def test_dequantize_errors():
    blocks, scales = random_mxfp4((2, 3, 2))
    bad_calls = [
        lambda: dequantize_mxfp4(blocks.float(), scales, name=NAME),  # float blocks
        lambda: dequantize_mxfp4(blocks, scales.to(torch.int32), name=NAME),
        lambda: dequantize_mxfp4(blocks[..., :8], scales, name=NAME),
        lambda: dequantize_mxfp4(blocks, scales[:, :2], name=NAME),
        lambda: dequantize_mxfp4(blocks, scales, rows_per_chunk=0, name=NAME),
        lambda: dequantize_gpt_oss_experts(blocks[0, 0], scales[0, 0], name=NAME),  # (G, 16)
        lambda: dequantize_gpt_oss_experts(blocks.float(), scales, name=NAME),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value) and NAME in str(err.value)
    with pytest.raises(ValueError, match=r"float32.*uint8"):
        dequantize_mxfp4(blocks.float(), scales)
