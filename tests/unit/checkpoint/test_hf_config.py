"""titanlab model args ⇄ Hugging Face config.json."""

import dataclasses
import os

import pytest
import torch

from titanlab.checkpoint.hf_config import from_hf_config, to_hf_config
from titanlab.models.llama3 import llama3_flavors

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers loads local folders only


def published(flavor: str) -> dict:
    return to_hf_config(
        dataclasses.replace(llama3_flavors[flavor], vocab_size=128256), dtype=torch.bfloat16
    )


def test_1b_config_has_the_published_llama_3_2_values():
    cfg = published("1B")
    assert {
        k: cfg[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "torch_dtype",
            "vocab_size",
        )
    } == {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


@pytest.mark.parametrize(
    "flavor,ffn", [("3B", 8192), ("8B", 14336), ("70B", 28672), ("405B", 53248)]
)
def test_published_intermediate_sizes(flavor, ffn):
    assert published(flavor)["intermediate_size"] == ffn


@pytest.mark.parametrize("flavor", list(llama3_flavors))
def test_flavor_is_inferred_back(flavor):
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=1000)
    name, back = from_hf_config(to_hf_config(args, dtype=torch.float32))
    assert name == flavor and back == args


def test_transformers_5_rope_parameters_form_is_read():
    cfg = published("8B")
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    name, args = from_hf_config(cfg, "8B")
    assert name == "8B" and args.rope_scaling == llama3_flavors["8B"].rope_scaling


@pytest.mark.parametrize(
    "key,value,msg",
    [
        ("num_key_value_heads", 4, "num_key_value_heads=4 (the flavor has 8)"),
        ("rope_theta", 10000.0, "rope_theta=10000.0 (the flavor has 500000.0)"),
        ("tie_word_embeddings", True, "tie_word_embeddings=True (the flavor has False)"),
        ("rope_scaling", None, "rope_scaling=None"),
    ],
)
def test_mismatch_with_chosen_flavor_names_the_key(key, value, msg):
    cfg = {**published("8B"), key: value}
    with pytest.raises(ValueError) as e:
        from_hf_config(cfg, "8B")
    assert "does not match flavor '8B'" in str(e.value) and msg in str(e.value)
    assert "\n" not in str(e.value)


def test_no_flavor_matches_lists_the_valid_ones():
    with pytest.raises(ValueError, match="matches no titanlab flavor; valid: debugmodel"):
        from_hf_config({**published("8B"), "num_hidden_layers": 7})


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"attention_bias": True}, "attention_bias=true"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope type 'yarn' is not supported",
        ),
        ({"vocab_size": None}, "vocab_size=None"),
    ],
)
def test_unsupported_configs(change, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        from_hf_config({**published("8B"), **change})


def test_unknown_flavor():
    with pytest.raises(ValueError, match="flavor='9B' is unknown; valid: debugmodel"):
        from_hf_config(published("8B"), "9B")


def test_transformers_reads_the_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**published("1B"))
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert config.num_key_value_heads == 8 and config.tie_word_embeddings
