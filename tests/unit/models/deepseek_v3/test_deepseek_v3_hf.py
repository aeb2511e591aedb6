"""DeepSeek-V3 against transformers: import, logits, bitwise round trips, one-line refusals.

Three shapes cover the architecture's switches: query compression on and off, dense first
blocks (0, 1, 2), group-limited routing (1, 2, 4 groups), one or two shared experts, default
and YaRN RoPE. The routing bias is random, so a bias dropped on import changes which experts
run.
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "qwen3"))
from test_qwen3_hf import VOCAB, import_and_check, random_hf_model

from titanlab.checkpoint.convert import hf_to_dcp
from titanlab.models.deepseek_v3.hf import from_config
from titanlab.models.stored_args import read_model_args

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
SHAPES = {
    "q_lora, 1 dense, 2 groups": dict(q_lora_rank=24, first_k_dense_replace=1, n_group=2,
                                      topk_group=1),
    "no q_lora, 0 dense, 4 groups of 2, yarn": dict(
        q_lora_rank=None, first_k_dense_replace=0, n_group=4, topk_group=2, rope_parameters=YARN
    ),
    "q_lora, 2 dense, 1 group, 2 shared, yarn": dict(
        q_lora_rank=24, first_k_dense_replace=2, n_group=1, topk_group=1, n_shared_experts=2,
        num_hidden_layers=4, rope_parameters=YARN,
    ),
}  # fmt: skip


def ds_config(**change):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,  # ≠ qk_nope_head_dim: a wrong split of kv_b_proj shows
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=64,
        num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["DeepseekV3ForCausalLM"],
    )
    return transformers.DeepseekV3Config(**{**base, **change})


def random_ds_model(config):
    model = random_hf_model(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_deepseek_v3_imports_with_transformers_logits_and_round_trips(shape, tmp_path):
    import_and_check(random_ds_model(ds_config(**SHAPES[shape])), tmp_path)
    stored = read_model_args(str(tmp_path / "dcp"))
    assert stored is not None and stored[0].name == "deepseek_v3" and stored[1] == "hf"


def _refusal(tmp_path, key, value) -> str:
    hf = tmp_path / "hf"
    random_ds_model(ds_config(num_hidden_layers=1)).save_pretrained(str(hf))
    cfg = json.loads((hf / "config.json").read_text())
    cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(hf), str(tmp_path / "dcp"), progress=False)
    return str(e.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
        ("rope_interleave", False),
        ("num_key_value_heads", 2),
        ("attention_bias", True),
        ("moe_layer_freq", 2),
        ("quantization_config", {"quant_method": "fp8"}),
        ("model_type", "deepseek_v2"),
    ],
)
def test_a_config_field_deepseek_v3_cannot_honour_is_one_line(key, value, tmp_path):
    message = _refusal(tmp_path, key, value)
    assert "\n" not in message and key in message, message


def test_group_settings_that_do_not_fit_are_one_line():
    cfg = ds_config().to_dict()
    for change in ({"n_group": 3}, {"topk_group": 3, "n_group": 2}):
        with pytest.raises(ValueError) as e:
            from_config({**cfg, **change}).validate()
        assert "\n" not in str(e.value)


def test_a_bf16_export_keeps_the_router_gate_and_bias_fp32(tmp_path):
    """transformers keeps DeepSeek-V3's gate and bias in fp32; a bias rounded to bf16 routes
    differently, so to-hf writes those two in fp32 whatever --dtype."""
    from test_qwen3_hf import read_folder

    from titanlab.checkpoint.convert import dcp_to_hf

    random_ds_model(ds_config()).save_pretrained(str(tmp_path / "hf"))
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "bf16"), dtype=torch.bfloat16, progress=False)
    original, tensors = read_folder(str(tmp_path / "hf")), read_folder(str(tmp_path / "bf16"))
    router = [k for k in tensors if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert len(router) == 4  # 2 MoE blocks × (gate, bias)
    for k, v in tensors.items():
        assert v.dtype == (torch.float32 if k in router else torch.bfloat16), k
        if k in router:
            assert torch.equal(v, original[k])


def transformers_default_mtp(**change):
    """`ds_config` with transformers' own MTP setting: DeepseekV3Config declares one
    multi-token prediction depth (`num_nextn_predict_layers=1`) unless told otherwise, while its
    DeepseekV3ForCausalLM has no MTP modules, so `save_pretrained` writes no MTP tensors."""
    fields = ds_config(**change).to_dict()
    fields = {
        k: v for k, v in fields.items() if k not in ("num_mtp_layers", "num_nextn_predict_layers")
    }
    config = transformers.DeepseekV3Config(**fields)
    assert config.num_nextn_predict_layers == 1
    return config


def test_a_folder_saved_by_transformers_imports_without_the_mtp_depths_it_lacks(tmp_path, caplog):
    """Before, this folder was refused: "lacks tensor model.layers.3.enorm.weight"."""
    import logging

    with caplog.at_level(logging.WARNING, logger="titanlab.checkpoint.convert.from_hf"):
        import_and_check(random_ds_model(transformers_default_mtp()), tmp_path)  # its logits
    stored = read_model_args(str(tmp_path / "dcp"))
    assert stored is not None and stored[2].mtp_layers == 0
    said = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "declares 1 multi-token prediction depth(s)" in said[0]
    assert "holds no tensor of layers 3..3" in said[0] and "mtp_layers 0" in said[0]


def test_a_folder_with_part_of_an_mtp_depth_is_one_line_and_imports_with_no_mtp(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    random_ds_model(transformers_default_mtp()).save_pretrained(str(hf))
    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)  # one tensor of MTP depth 0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(hf), str(tmp_path / "dcp"), progress=False)
    line = str(e.value)
    assert "\n" not in line and "lacks tensor model.layers.3." in line, line
    assert "multi-token prediction depth 0 (layer num_hidden_layers + 0" in line
    assert "from-hf --no-mtp" in line
    assert not (tmp_path / "dcp").exists()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))))  # fmt: skip
    from tools import convert_checkpoint

    dcp = str(tmp_path / "dcp")
    assert convert_checkpoint.main(["from-hf", str(hf), dcp, "--no-mtp", "--quiet"]) == 0
    stored = read_model_args(dcp)
    assert stored is not None and stored[2].mtp_layers == 0
