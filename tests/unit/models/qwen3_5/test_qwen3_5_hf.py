"""Qwen3.5 (dense and MoE) against transformers' `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` on random weights: a saved folder imports through `hf_to_dcp` with
logits within 1e-4 (fp32) on shapes whose linear and full layers differ in heads and dims, key
heads ≠ value heads, convolutions of 2 and 4 taps, full attention every 2nd or 4th layer, and
sequences not a multiple of the 64-token chunk; HF → DCP → HF and DCP → HF → DCP are bitwise."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "qwen3"))
from test_qwen3_hf import VOCAB, read_folder, real_tokens

from titanlab.checkpoint.convert import DcpModelReader, dcp_to_hf, hf_to_dcp
from titanlab.models.registry import build_model
from titanlab.models.stored_args import read_model_args

transformers = pytest.importorskip("transformers")

SHAPES = {  # name: (config changes, sequence length)
    "dense-interval4-conv4": (dict(linear_num_key_heads=2, linear_num_value_heads=4), 77),
    "dense-interval2-conv2-tied": (
        dict(
            full_attention_interval=2,
            linear_conv_kernel_dim=2,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            num_hidden_layers=4,
        ),
        130,
    ),
    "moe-interval4-conv4": (dict(linear_num_key_heads=1, linear_num_value_heads=3, moe=True), 70),
    "moe-interval2-conv2": (
        dict(
            full_attention_interval=2,
            linear_conv_kernel_dim=2,
            num_key_value_heads=4,
            head_dim=16,
            moe=True,
            shared_expert_intermediate_size=48,
        ),
        65,
    ),
}


def hf_config(moe: bool = False, full_attention_interval: int = 4, **change):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_conv_kernel_dim=4, max_position_embeddings=256,
    )  # fmt: skip
    if moe:
        base.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2)  # fmt: skip
    cfg = {**base, **change}
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    if moe:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

        del cfg["intermediate_size"]
        return Qwen3_5MoeTextConfig(**cfg, architectures=["Qwen3_5MoeForCausalLM"])
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**cfg, architectures=["Qwen3_5ForCausalLM"])


def random_model(config, seed: int = 0):
    """Random weights with every parameter perturbed (norms around their identity, the decay's
    A in a trained range): an identity norm or a default init would hide a wrong layout."""
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 3.0).log())
            elif "norm" in name or name.endswith(("dt_bias", "conv1d.weight")):
                p.normal_(0.0 if "layernorm" in name or "q_norm" in name or "k_norm" in name
                          or name == "model.norm.weight" else 1.0, 0.3)  # fmt: skip
            else:
                p.normal_(0.0, 0.05)
    return model


def import_model(hf_model, tmp_path, seq):
    hf_dir, dcp_dir = tmp_path / "hf", tmp_path / "dcp"
    hf_model.save_pretrained(str(hf_dir), safe_serialization=True)
    args = hf_to_dcp(str(hf_dir), str(dcp_dir), progress=False)
    stored = read_model_args(str(dcp_dir))
    assert stored is not None and stored[2] == args
    reader = DcpModelReader(str(dcp_dir))
    model = build_model(dataclasses.replace(args, max_seq_len=seq)).eval()
    model.load_state_dict({k: reader.load(k) for k in model.state_dict()})
    return model, reader


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_equal_transformers_and_round_trips_are_bitwise(shape, tmp_path):
    change, seq = SHAPES[shape]
    hf_model = random_model(hf_config(**change))
    model, reader = import_model(hf_model, tmp_path, seq)
    tokens = real_tokens(2, seq)
    with torch.no_grad():
        want = hf_model(tokens).logits
        diff = (want - model(tokens)).abs().max().item()
    print(f"{shape}: max |logits diff| = {diff:.3g} (logits std {want.std():.3g})")
    assert diff <= 1e-4

    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf2"), dtype=torch.float32, progress=False)
    want_t, got_t = read_folder(str(tmp_path / "hf")), read_folder(str(tmp_path / "hf2"))
    assert want_t.keys() == got_t.keys()
    assert all(torch.equal(want_t[k], got_t[k]) for k in want_t)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["architectures"] == hf_model.config.architectures
    hf_to_dcp(str(tmp_path / "hf2"), str(tmp_path / "dcp2"), progress=False)
    back = DcpModelReader(str(tmp_path / "dcp2"))
    assert back.tensors.keys() == reader.tensors.keys()
    assert all(torch.equal(back.load(k), reader.load(k)) for k in reader.tensors)


def test_the_export_loads_in_transformers_with_the_same_logits(tmp_path):
    """titanlab's own weights (its init) exported to HF: transformers loads the folder and its
    logits equal titanlab's."""
    from titanlab.checkpoint.convert.to_hf import dcp_to_hf as _  # noqa: F401

    hf_model = random_model(hf_config(linear_num_key_heads=2, linear_num_value_heads=4))
    model, _reader = import_model(hf_model, tmp_path, 40)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf3"), dtype=torch.float32, progress=False)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf3")).eval()
    tokens = real_tokens(1, 40)
    with torch.no_grad():
        ours = model(tokens)
        assert (again(tokens).logits - ours).abs().max().item() <= 1e-4
        assert torch.equal(again(tokens).logits, loaded(tokens).logits)


def test_a_mutant_layout_is_caught(tmp_path):
    """The comparison can fail: the linear layers' q and k rows left in HF's order (no
    regrouping) give different logits."""
    hf_model = random_model(hf_config(linear_num_key_heads=2, linear_num_value_heads=4))
    model, _ = import_model(hf_model, tmp_path, 40)
    key = "layers.0.attention.wqkv.weight"
    sd = hf_model.state_dict()
    with torch.no_grad():
        model.state_dict()[key].copy_(sd["model.layers.0.linear_attn.in_proj_qkv.weight"])
        tokens = real_tokens(1, 40)
        assert (hf_model(tokens).logits - model(tokens)).abs().max().item() > 1e-3


def test_a_config_field_qwen3_5_cannot_honour_is_one_line():
    from titanlab.models.qwen3_5.hf import from_config

    cfg = hf_config().to_dict()
    with pytest.raises(ValueError, match=r"^config.json attention_bias=True is not supported"):
        from_config({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="layer_types has 3 entries for num_hidden_layers=5"):
        from_config({**cfg, "layer_types": ["linear_attention"] * 3})


def test_a_published_multimodal_config_reads_its_text_config():
    from titanlab.models.qwen3_5.args import qwen3_5_flavors
    from titanlab.models.registry import family_of_hf_config, matching_flavor

    text = {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
            "intermediate_size": 17408, "vocab_size": 248320, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                "mrope_interleaved": True},
            "attn_output_gate": True, "mtp_num_hidden_layers": 1}  # fmt: skip
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": text, "tie_word_embeddings": False}  # fmt: skip
    family = family_of_hf_config(cfg)
    args = family.hf.from_config(cfg)
    assert family.name == "qwen3_5" and matching_flavor(family, args) == "27B"
    assert args == dataclasses.replace(qwen3_5_flavors["27B"])


def test_moe_load_balance_loss_equals_transformers_per_layer(tmp_path):
    """Each MoE layer's Switch/GShard loss (titanlab's `last_aux`) equals transformers'
    `load_balancing_loss_func` of that layer's router logits."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from titanlab.models.common.decoder import moe_layers

    hf_model = random_model(hf_config(moe=True, num_hidden_layers=4))
    model, _ = import_model(hf_model, tmp_path, 40)
    tokens = real_tokens(2, 40)
    with torch.no_grad():
        out = hf_model(tokens, output_router_logits=True)
        model(tokens)
    layers = moe_layers(model)
    assert len(layers) == len(out.router_logits) == 4
    for moe, logits in zip(layers, out.router_logits, strict=True):
        theirs = load_balancing_loss_func((logits,), 8, 2).item()
        assert moe.last_aux is not None
        assert abs(moe.last_aux.item() - theirs) <= 1e-6, (moe.last_aux.item(), theirs)
