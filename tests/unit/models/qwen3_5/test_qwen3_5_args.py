"""Qwen3.5 flavors (dense and MoE): every published text model's parameter count equals, to the
parameter, the count of its released safetensors (vision tower and multi-token prediction head
left out: the import drops them); the MoE flavors' active counts; the layer schedule; one-line
refusals of bad args."""

import dataclasses

import pytest
import torch

from titanlab.models.common.counting import count_active_params, count_params
from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.linear_attention import GatedDeltaNet
from titanlab.models.common.norms import ZeroCenteredRMSNorm
from titanlab.models.qwen3_5 import Qwen35Transformer, qwen3_5_flavors, qwen3_5_moe_flavors

# Text parameters of the released checkpoints (their safetensors headers' counts minus the
# `model.visual.*` and `mtp.*` tensors; untied models include lm_head), and the model cards'
# rounded totals: Qwen/Qwen3.5-0.8B ... -397B-A17B.
TEXT_PARAMS = {
    "0.8B": 752_393_024,
    "2B": 1_881_825_088,
    "4B": 4_205_751_296,
    "9B": 8_953_803_264,
    "27B": 26_895_998_464,
    "35B-A3B": 34_660_610_688,
    "122B-A10B": 122_111_526_912,
    "397B-A17B": 396_346_350_336,
}
# Active parameters per token (k of each layer's routed experts, embeddings and head included):
# the cards' "A3B", "A10B", "A17B".
ACTIVE_PARAMS = {"35B-A3B": 3_454_988_928, "122B-A10B": 9_771_288_576,
                 "397B-A17B": 17_349_040_896}  # fmt: skip
FLAVORS = {**qwen3_5_flavors, **qwen3_5_moe_flavors}


def meta_model(flavor: str):
    with torch.device("meta"):
        return Qwen35Transformer(dataclasses.replace(FLAVORS[flavor], max_seq_len=8))


@pytest.mark.parametrize("flavor", list(TEXT_PARAMS))
def test_parameters_equal_the_released_checkpoints(flavor):
    model = meta_model(flavor)
    assert count_params(model) == TEXT_PARAMS[flavor]
    if flavor in ACTIVE_PARAMS:
        assert count_active_params(model) == ACTIVE_PARAMS[flavor]
        assert len(moe_layers(model)) == model.args.n_layers


def test_three_linear_layers_per_full_layer_and_their_modules():
    model = meta_model("27B")
    kinds = [isinstance(b.attention, GatedDeltaNet) for b in model.layers.values()]
    assert kinds == [True, True, True, False] * 16
    full = model.layers["3"].attention
    assert full.rotary_dim == 64 and full.output_gate and full.wq.out_features == 24 * 256 * 2
    assert isinstance(full.q_norm, ZeroCenteredRMSNorm) and isinstance(
        model.norm, ZeroCenteredRMSNorm
    )
    linear = model.layers["0"].attention
    assert linear.wqkv.out_features == 2 * 16 * 128 + 48 * 128
    assert linear.conv.weight.shape == (2 * 16 * 128 + 48 * 128, 1, 4)
    assert model.rope_cos.shape[-1] == 32  # tables for the rotary quarter of head_dim 256


def test_explicit_layer_types_override_the_interval():
    args = dataclasses.replace(qwen3_5_flavors["debugmodel"], vocab_size=64,
                               layer_types=("full_attention",) + ("linear_attention",) * 5)  # fmt: skip
    model = Qwen35Transformer(args)
    assert [isinstance(b.attention, GatedDeltaNet) for b in model.layers.values()] == [
        False, True, True, True, True, True,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"linear_value_heads": 6},
            "linear_value_heads=6 must be a multiple of linear_key_heads=4",
        ),
        ({"partial_rotary_factor": 0.01}, "gives rotary_dim=0; it must be even"),
        ({"layer_types": ("linear_attention",)}, "layer_types has 1 entries for n_layers=6"),
        ({"layer_types": ("mamba",) * 6}, "layer_types entry 'mamba'; valid: linear_attention"),
        ({"linear_conv_kernel": 0}, "linear_conv_kernel=0 must be positive"),
    ],
)
def test_bad_args_are_one_line(change, message):
    args = dataclasses.replace(qwen3_5_flavors["debugmodel"], vocab_size=64, **change)
    with pytest.raises(ValueError, match=message):
        args.validate()
