"""Qwen3-MoE against transformers: import, logits, load-balance loss, bitwise round trips."""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "qwen3"))
from test_qwen3_hf import VOCAB, import_and_check, random_hf_model, real_tokens

from titanlab.checkpoint.convert import DcpModelReader, hf_to_dcp
from titanlab.models.common.decoder import moe_layers
from titanlab.models.registry import build_model

transformers = pytest.importorskip("transformers")


def moe_config(**change):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # one dense block between two MoE blocks
        architectures=["Qwen3MoeForCausalLM"],
    )
    return transformers.Qwen3MoeConfig(**{**base, **change})


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_imports_with_transformers_logits_and_round_trips(norm_topk_prob, tmp_path):
    import_and_check(random_hf_model(moe_config(norm_topk_prob=norm_topk_prob)), tmp_path)


def _imported(hf_model, tmp_path):
    hf_model.save_pretrained(str(tmp_path / "hf"))
    args = hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    reader = DcpModelReader(str(tmp_path / "dcp"))
    model = build_model(dataclasses.replace(args, max_seq_len=64)).eval()
    model.load_state_dict({k: reader.load(k) for k in model.state_dict()})
    return model


def test_load_balance_loss_equals_transformers_per_layer(tmp_path):
    """titanlab's aux loss is the Switch/GShard loss of each MoE layer (averaged over layers);
    transformers' `load_balancing_loss_func` of each layer's router logits gives the same
    values. With one MoE layer it is transformers' `aux_loss` itself."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf_model = random_hf_model(moe_config())
    model = _imported(hf_model, tmp_path)
    tokens = real_tokens()
    with torch.no_grad():
        out = hf_model(tokens, output_router_logits=True)
        model(tokens)
    layers = moe_layers(model)
    assert len(layers) == len(out.router_logits) == 2
    for moe, logits in zip(layers, out.router_logits, strict=True):
        theirs = load_balancing_loss_func((logits,), 8, 2).item()
        assert moe.last_aux is not None
        assert abs(moe.last_aux.item() - theirs) <= 1e-6, (moe.last_aux.item(), theirs)


def test_one_moe_layer_aux_loss_is_transformers_aux_loss(tmp_path):
    hf_model = random_hf_model(moe_config(num_hidden_layers=2, mlp_only_layers=[0]))
    model = _imported(hf_model, tmp_path / "one")
    tokens = real_tokens()
    with torch.no_grad():
        theirs = hf_model(tokens, output_router_logits=True).aux_loss.item()
        model(tokens)
    (moe,) = moe_layers(model)
    assert moe.last_aux is not None and abs(moe.last_aux.item() - theirs) <= 1e-6
