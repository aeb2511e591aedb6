"""DeepSeek-V3 args: every flavor builds, published parameter counts, one-line validation."""

import dataclasses

import pytest
import torch

from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.counting import count_active_params, count_params, describe_params
from titanlab.models.common.mla import MLAttention
from titanlab.models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_flavors
from titanlab.models.registry import get_family

# (total, active) parameters, the MTP module excluded: DeepSeek-V3 "671B total, 37B activated"
# (arXiv:2412.19437, Abstract); Moonlight-16B-A3B "16B total, 3B activated". The exact values
# follow from the published config.json files (docs/design/deepseek_v3.md §5).
PUBLISHED = {
    "671B": (671_026_404_352, 37_552_282_624),
    "16B": (15_960_108_544, 2_914_774_528),
}


def _meta(flavor: str) -> DeepSeekV3Transformer:
    args = deepseek_v3_flavors[flavor]
    if args.vocab_size <= 0:
        args = dataclasses.replace(args, vocab_size=1000)
    with torch.device("meta"):
        return DeepSeekV3Transformer(args)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor):
    """The main model's counts (the published ones leave the MTP depth out); 671B's MTP depth
    is 11.6B more (README_WEIGHTS.md of deepseek-ai/DeepSeek-V3: "11.5B unique")."""
    model = _meta(flavor)
    mtp = count_params(model.mtp) if model.mtp is not None else 0
    total, active = count_params(model) - mtp, count_active_params(model)
    if model.mtp is not None:
        active -= count_active_params(model.mtp)
    print(f"deepseek_v3 {flavor}: {total:,} total, {active:,} active, MTP {mtp:,}")
    assert (total, active) == PUBLISHED[flavor]
    assert mtp == (11_610_067_968 if flavor == "671B" else 0)
    if flavor == "671B":  # the trainer's `model:` line says what its larger count includes
        assert describe_params(model) == (
            "682,636,472,320 parameters (38,240,382,976 active per token), of them "
            "11,610,067,968 (688,100,352 active) in the multi-token prediction depths, which "
            "inference does not use"
        )


@pytest.mark.parametrize("flavor", list(deepseek_v3_flavors))
def test_every_flavor_builds_with_mla_and_dense_first_blocks(flavor):
    model = _meta(flavor)
    args = model.args
    blocks = [model.layers[str(i)] for i in range(args.n_layers)]
    assert all(isinstance(b.attention, MLAttention) for b in blocks)
    assert all((b.attention.wq is None) == (args.q_lora_rank > 0) for b in blocks)
    assert len(moe_layers(model)) == args.n_layers - args.n_dense_layers + args.mtp_layers
    assert (model.mtp is None) == (args.mtp_layers == 0)
    assert get_family("deepseek_v3").flavors[flavor] is deepseek_v3_flavors[flavor]


def test_671b_softmax_scale_carries_yarn_mscale():
    # 192 ** -0.5 * (0.1 * ln 40 + 1) ** 2 (YaRN; transformers' DeepseekV3Attention.scaling)
    assert deepseek_v3_flavors["671B"].softmax_scale == pytest.approx(0.135234, rel=1e-5)
    assert deepseek_v3_flavors["16B"].softmax_scale == 192**-0.5


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"n_dense_layers": 7}, "n_dense_layers"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"vocab_size": -1}, "vocab_size"),
    ],
)
def test_bad_args_are_one_line(change, named):
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], **{"vocab_size": 1000, **change})
    with pytest.raises(ValueError, match=named) as e:
        args.validate()
    assert "\n" not in str(e.value)
