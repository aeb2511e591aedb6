"""Llama 3 args ⇄ a Hugging Face `LlamaForCausalLM` config.json (titanlab.models.llama3.hf)."""

import dataclasses
import os

import pytest
import torch

from titanlab.models.common.hf_config import special_token_ids
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.llama3.hf import from_config, to_config
from titanlab.models.registry import get_family, matching_flavor

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers loads local folders only


def to_hf_config(args, dtype=torch.float32) -> dict:
    return to_config(args, dtype, 131072, *special_token_ids(args.vocab_size))


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
def test_args_derived_from_a_flavor_config_build_the_same_model(flavor):
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=1000)
    back = from_config(to_hf_config(args))
    assert to_hf_config(back) == to_hf_config(args)  # the same architecture, field by field
    assert matching_flavor(get_family("llama3"), back) == flavor


def test_transformers_5_rope_parameters_form_is_read():
    cfg = published("8B")
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    args = from_config(cfg)
    assert args.rope_scaling == llama3_flavors["8B"].rope_scaling and args.rope_theta == 500000.0


def test_a_config_of_no_flavor_imports_with_its_own_values():
    """SmolLM-135M's shape: 9 heads, 3 KV heads, 30 layers, eps 1e-5, theta 10000, tied."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    }
    args = from_config(cfg)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.head_dim) == (
        576,
        30,
        9,
        3,
        64,
    )
    assert args.ffn_hidden_dim() == 1536 and args.norm_eps == 1e-6 and args.tie_word_embeddings
    assert matching_flavor(get_family("llama3"), args) is None


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"attention_bias": True}, "attention_bias=True is not supported by titanlab's llama3"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 256}, "head_dim=256"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope type 'yarn' is not supported",
        ),
        ({"vocab_size": None}, "vocab_size=None must be a positive int"),
    ],
)
def test_unsupported_configs(change, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        from_config({**published("8B"), **change})


def test_transformers_reads_the_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**published("1B"))
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert config.num_key_value_heads == 8 and config.tie_word_embeddings
