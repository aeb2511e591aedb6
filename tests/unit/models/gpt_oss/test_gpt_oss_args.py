"""gpt-oss flavors at their real size (meta device) against the model card's parameter counts,
the args' one-line refusals, the blocks' modules, and the window-aware FLOPs count."""

import dataclasses

import pytest
import torch

from titanlab.models.common.counting import count_active_params, count_params, flops_per_token
from titanlab.models.common.experts import ClampedSwiGLUExperts
from titanlab.models.gpt_oss.args import gpt_oss_flavors
from titanlab.models.registry import build_model, get_family


def meta_model(flavor):
    with torch.device("meta"):
        return build_model(gpt_oss_flavors[flavor])


# OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), Table 1: total 20.91B / 116.83B,
# active per token 3.61B / 5.13B (the active count leaves the embedding out, keeps the head).
@pytest.mark.parametrize(
    "flavor, total, active",
    [("20b", 20_914_757_184, 3_608_307_264), ("120b", 116_829_156_672, 5_132_849_472)],
)
def test_published_flavors_have_the_model_cards_parameter_counts(flavor, total, active):
    model = meta_model(flavor)
    embedding = model.tok_embeddings.weight.numel()
    assert count_params(model) == total
    assert count_active_params(model) - embedding == active
    card_total, card_active = {"20b": (20.91e9, 3.61e9), "120b": (116.83e9, 5.13e9)}[flavor]
    assert abs(total - card_total) < 0.005e9 and abs(active - card_active) < 0.005e9


def test_blocks_alternate_sliding_and_full_with_sinks_biases_and_clamped_experts():
    model = meta_model("20b")
    windows = [block.attention.window for block in model.layers.values()]
    assert windows == [128, None] * 12
    block = model.layers["0"]
    assert block.attention.sinks.weight.shape == (64,)
    assert all(getattr(block.attention, w).bias is not None for w in ("wq", "wk", "wv", "wo"))
    assert block.feed_forward.router.gate.bias.shape == (32,)
    experts = block.feed_forward.experts
    assert isinstance(experts, ClampedSwiGLUExperts)
    assert experts.gate_up_proj.shape == (32, 2880, 5760)
    assert experts.down_proj_bias.shape == (32, 2880)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sliding_window": 0}, "sliding_window=0 must be positive"),
        ({"layer_types": ("full_attention",) * 3}, "layer_types has 3 entries"),
        (
            {"layer_types": ("full_attention", "local", "full_attention", "full_attention")},
            "layer_types entry 'local'",
        ),
        ({"n_kv_heads": 3}, "n_kv_heads=3"),
    ],
)
def test_bad_args_are_one_line(change, message):
    args = dataclasses.replace(gpt_oss_flavors["debugmodel"], vocab_size=64, **change)
    with pytest.raises(ValueError) as e:
        args.validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sliding_layers_attention_flops_are_counted_over_their_window():
    """At seq 4096 the 12 sliding blocks of 20b charge 128 keys, the 12 full ones 4096: the
    attention term is (12 · 128 + 12 · 4096) / (24 · 4096) of the full-attention count."""
    args = gpt_oss_flavors["20b"]
    family = get_family("gpt_oss")
    n = 3_000_000_000
    ours = family.flops_per_token(args, 4096, n) - 6 * n
    full = flops_per_token(args, 4096, n) - 6 * n
    assert ours * 24 * 4096 == full * (12 * 128 + 12 * 4096)
    print(f"20b attention FLOPs/token at seq 4096: {ours:.3e} (windowed) vs {full:.3e} (full)")
