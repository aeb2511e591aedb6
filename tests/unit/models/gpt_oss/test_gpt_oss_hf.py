"""gpt-oss against transformers' `GptOssForCausalLM`: import, logits on several shapes (window
longer and shorter than the sequence, sinks large and zero), load-balance loss, bitwise round
trips, and refused config fields."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "qwen3"))
from test_qwen3_hf import VOCAB, import_and_check, random_hf_model, real_tokens

from titanlab.checkpoint.convert import hf_to_dcp

transformers = pytest.importorskip("transformers")


def gpt_oss_config(**change):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        architectures=["GptOssForCausalLM"],
    )
    config = transformers.GptOssConfig(**{**base, **change})
    config._attn_implementation = "eager"
    return config


def random_gpt_oss(config, sinks_scale: float = 1.0):
    """Random weights, biases and sinks included (transformers initializes biases to zero and
    sinks to small values; both are drawn here so that a wrong mapping cannot hide)."""
    model = random_hf_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0).mul_(sinks_scale)
    return model


@pytest.mark.parametrize(
    "change, sinks_scale",
    [
        ({}, 1.0),  # window 8 < 64 tokens, alternating layers
        ({"sliding_window": 128}, 3.0),  # window longer than the sequence, large sinks
        ({"sliding_window": 5, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, 0.0),
        ({"sliding_window": 20, "num_key_value_heads": 4, "attention_bias": False}, 1.0),
    ],
)
def test_gpt_oss_imports_with_transformers_logits_and_round_trips(change, sinks_scale, tmp_path):
    import_and_check(random_gpt_oss(gpt_oss_config(**change), sinks_scale), tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_a_config_field_gpt_oss_cannot_honour_is_one_line(change, message, tmp_path):
    random_gpt_oss(gpt_oss_config(**change)).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_experts_import_dequantized_with_transformers_logits(tmp_path):
    """A folder laid out like the released checkpoints (`quantization_config` mxfp4, experts as
    `*_blocks` / `*_scales`): the import dequantizes them, and its logits equal transformers'
    model holding transformers' own dequantization of the same bytes (fp32, 1e-4)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = random_gpt_oss(gpt_oss_config(intermediate_size=64))  # MXFP4: 32 | in
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(str(hf_dir))
    (file,) = hf_dir.glob("*.safetensors")
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(1)
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = tensors.pop(name).shape  # (E, in, out): packed as (E, out, in/32, 16)
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen)
            scales = torch.randint(118, 124, (e, rows, cols // 32), generator=gen)
            blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            hf_model.get_parameter(name).data.copy_(weight)
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    args = hf_to_dcp(str(hf_dir), str(tmp_path / "dcp"), dtype=torch.float32, progress=False)
    model = _load(args, tmp_path / "dcp")
    tokens = real_tokens()
    with torch.no_grad():
        diff = (hf_model(tokens).logits - model(tokens)).abs().max().item()
    print(f"MXFP4 import: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-4


def test_an_mxfp4_pair_of_a_bad_shape_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    random_gpt_oss(gpt_oss_config(intermediate_size=64)).save_pretrained(str(tmp_path / "hf"))
    (file,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.experts.down_proj"
    del tensors[name]
    tensors[name + "_blocks"] = torch.zeros(8, 64, 1, 8, dtype=torch.uint8)  # 8 bytes, not 16
    tensors[name + "_scales"] = torch.zeros(8, 64, 1, dtype=torch.uint8)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    assert "down_proj" in str(e.value) and "16" in str(e.value) and "\n" not in str(e.value)


def _load(args, dcp_dir):
    import dataclasses

    from titanlab.checkpoint.convert import DcpModelReader
    from titanlab.models.registry import build_model

    reader = DcpModelReader(str(dcp_dir))
    model = build_model(dataclasses.replace(args, max_seq_len=64)).eval()
    model.load_state_dict({k: reader.load(k).float() for k in model.state_dict()})
    return model


def test_sinks_of_another_head_count_are_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    random_gpt_oss(gpt_oss_config()).save_pretrained(str(tmp_path / "hf"))
    (file,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(file))
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(6)  # 4 heads in config.json
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    message = str(e.value)
    assert "model.layers.1.self_attn.sinks" in message and "[6]" in message and "[4]" in message
    assert "\n" not in message


def test_load_balance_loss_equals_transformers_per_layer(tmp_path):
    """titanlab's aux loss of each MoE layer (softmax over the biased gate's logits) equals
    transformers' `load_balancing_loss_func` of that layer's router logits."""
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    hf_model = random_gpt_oss(gpt_oss_config())
    hf_model.save_pretrained(str(tmp_path / "hf"))
    args = hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    model = _load(args, tmp_path / "dcp")
    tokens = real_tokens()
    with torch.no_grad():
        out = hf_model(tokens, output_router_logits=True)
        model(tokens)
    from titanlab.models.common.decoder import moe_layers

    layers = moe_layers(model)
    assert len(layers) == len(out.router_logits) == 4
    for moe, logits in zip(layers, out.router_logits, strict=True):
        theirs = load_balancing_loss_func((logits,), 8, 2).item()
        assert moe.last_aux is not None
        assert abs(moe.last_aux.item() - theirs) <= 1e-6, (moe.last_aux.item(), theirs)
