"""LoRA module swaps: the targeted Linears only, frozen base, an unchanged output at init, the
adapter formula W x + (alpha/r) B A x, layout-independent adapter init, one-line errors."""

import dataclasses

import pytest
import torch

from titanlab.config.job_config import ConfigError
from titanlab.config.peft import Peft
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model
from titanlab.peft.lora import LoRALinear, apply_lora, init_adapters, is_adapter, lora_targets

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, vocab_size=97, max_seq_len=32)  # fmt: skip


def model(seed: int = 0):
    torch.manual_seed(seed)
    m = build_model(ARGS)
    m.init_weights()
    return m


def test_targets_are_swapped_and_everything_else_frozen():
    m = model()
    n = apply_lora(m, Peft(method="lora", rank=4, target_modules=["wq", "w2"]))
    assert n == 4  # 2 layers × (wq, w2)
    assert isinstance(m.layers["0"].attention.wq, LoRALinear)
    assert not isinstance(m.layers["0"].attention.wk, LoRALinear)
    trainable = [name for name, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(name) for name in trainable)
    assert "layers.0.attention.wq.weight" in m.state_dict()  # the base keeps its name


def test_fresh_adapters_leave_the_output_unchanged_and_the_formula_holds():
    tokens = torch.randint(0, 97, (2, 16))
    plain = model()
    want = plain(tokens)
    m = model()
    apply_lora(m, Peft(method="lora", rank=4, alpha=8.0, target_modules=["wq", "wv", "w1"]))
    init_adapters([m], seed=3)
    torch.testing.assert_close(m(tokens), want)
    layer = m.layers["1"].feed_forward.w1
    torch.nn.init.normal_(layer.lora_b.weight)
    x = torch.randn(3, 64)
    expect = x @ layer.weight.T + 2.0 * (x @ layer.lora_a.weight.T) @ layer.lora_b.weight.T
    torch.testing.assert_close(layer(x), expect)


def test_adapter_init_is_the_same_under_activation_checkpoint_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = Peft(method="lora", rank=4)
    a, b = model(), model()
    apply_lora(a, cfg)
    apply_lora(b, cfg)
    b.layers["0"] = checkpoint_wrapper(b.layers["0"])
    init_adapters([a], seed=1)
    init_adapters([b], seed=1)
    wrapped = b.layers["0"]._checkpoint_wrapped_module.attention.wq.lora_a.weight
    assert torch.equal(a.layers["0"].attention.wq.lora_a.weight, wrapped)
    assert not torch.equal(wrapped, a.layers["0"].attention.wk.lora_a.weight)


def test_unknown_target_is_one_line():
    with pytest.raises(ConfigError) as e:
        apply_lora(model(), Peft(method="lora", target_modules=["wq", "q_proj"]))
    assert str(e.value) == (
        "peft.target_modules ['q_proj'] match no Linear layer of the model; its Linear layers "
        "are named output, w1, w2, w3, wk, wo, wq, wv"
    )


def test_the_router_and_a_tied_output_head_are_refused_with_one_line():
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    moe = build_model(dataclasses.replace(qwen3_moe_flavors["debugmodel_deep"], vocab_size=97))
    with pytest.raises(ConfigError) as e:
        lora_targets(moe, Peft(method="lora", target_modules=["wq", "gate"]), "qwen3_moe")
    assert str(e.value) == (
        "peft.target_modules ['gate']: the router of an MoE model is not a LoRA target (it "
        "computes in fp32 outside the adapted layers); adapt attention (wq, wk, wv, wo) or output"
    )
    with pytest.raises(ConfigError, match=r"^peft.target_modules \['w1'\] match no Linear layer "
                       r"of model.name=qwen3_moe; its Linear layers are named gate, output, "):  # fmt: skip
        lora_targets(moe, Peft(method="lora", target_modules=["w1"]), "qwen3_moe")
    tied = build_model(dataclasses.replace(ARGS, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="ties the output head to the embedding"):
        lora_targets(tied, Peft(method="lora", target_modules=["wq", "output"]))
    assert set(lora_targets(model(), Peft(method="lora", target_modules=["output"]))) == {"output"}


def test_the_frozen_base_goes_to_the_compute_dtype_but_a_router_stays_fp32():
    """LoRA on an MoE model under fp16/bf16 crashed in the first forward: the frozen router
    weight was stored in fp16 while the router computes in fp32."""
    from titanlab.models.qwen3_moe import qwen3_moe_flavors
    from titanlab.peft.lora import store_frozen_in

    moe = build_model(dataclasses.replace(qwen3_moe_flavors["debugmodel_deep"], vocab_size=97))
    moe.init_weights()
    apply_lora(moe, Peft(method="lora", target_modules=["wq", "output"]))
    store_frozen_in(moe, torch.float16)
    dtypes = {name: p.dtype for name, p in moe.named_parameters()}
    assert dtypes["layers.0.feed_forward.router.gate.weight"] == torch.float32
    assert dtypes["layers.0.attention.wk.weight"] == torch.float16
    assert dtypes["layers.0.attention.wq.lora_a.weight"] == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert moe(torch.randint(0, 97, (1, 8))).shape == (1, 8, 97)
