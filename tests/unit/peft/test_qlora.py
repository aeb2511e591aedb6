"""QLoRA's NF4 base: quantized whole from the base checkpoint, the forward equals the model
with the dequantized weights, only adapters train, initialization leaves NF4 alone, the bytes
are about 0.26 of bf16's, and each bad input is one line."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.config.peft import Peft
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model
from titanlab.peft.lora import apply_lora, init_adapters, store_frozen_in
from titanlab.peft.qlora import (
    adapted_base_bytes,
    hide_quantized,
    is_quantized,
    quantize_base,
    quantized_bytes,
    shard_problem,
    to_empty_keeping_quantized,
)

to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=128, n_layers=2, n_heads=4,
                           n_kv_heads=4, hidden_dim=256, vocab_size=97, max_seq_len=32)  # fmt: skip
ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(a trained-looking random base model, its DCP checkpoint folder)."""
    torch.manual_seed(0)
    model = build_model(ARGS)
    model.init_weights()
    path = str(tmp_path_factory.mktemp("base"))
    with pytest.warns(UserWarning):  # no process group: DCP saves as one process
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return model, path


def qlora_model(path: str, targets=ALL):
    """The trainer's order on one process: meta model, LoRA, NF4 base, materialize, init, load
    the rest of the base."""
    with torch.device("meta"):
        model = build_model(ARGS)
    apply_lora(model, Peft(method="lora", rank=4, alpha=8.0, target_modules=targets))
    count = quantize_base(model, path, shards=1)
    to_empty_keeping_quantized(model, "cpu")
    with hide_quantized([model]):
        model.init_weights()
    rest = {k: v for k, v in model.state_dict().items() if not is_quantized(v)}
    rest = {k: v for k, v in rest.items() if ".lora_" not in k and not k.startswith("rope_")}
    dcp.load({"model": rest}, checkpoint_id=path)
    model.load_state_dict(rest, strict=False)
    init_adapters([model], seed=1)
    return model, count


def test_the_nf4_base_is_the_whole_weight_quantized_and_the_forward_uses_it(base):
    plain, path = base
    model, count = qlora_model(path)
    assert count == 2 * len(ALL)
    wq = model.layers["0"].attention.wq
    assert is_quantized(wq.weight) and not wq.weight.requires_grad
    original = plain.layers["0"].attention.wq.weight.detach()
    dequant = wq.weight.get_original_weight()
    assert torch.equal(dequant, to_nf4(original, 64, 256).get_original_weight())
    rel = (dequant - original).norm() / original.norm()
    assert 0 < rel < 0.15, rel  # 4-bit: close, not equal
    # The forward equals the plain model holding the dequantized weights.
    torch.nn.init.normal_(wq.lora_b.weight)
    reference = build_model(ARGS)
    reference.load_state_dict(plain.state_dict())
    apply_lora(reference, Peft(method="lora", rank=4, alpha=8.0, target_modules=ALL))
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_a"):
                ref = reference.get_submodule(name)
                ref.weight.copy_(module.weight.get_original_weight())
                ref.lora_a.weight.copy_(module.lora_a.weight)
                ref.lora_b.weight.copy_(module.lora_b.weight)
    tokens = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-5, rtol=1e-5)
    # Only the adapters receive gradients.
    model(tokens).float().pow(2).mean().backward()
    assert wq.lora_a.weight.grad is not None and wq.weight.grad is None
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


def test_initialization_leaves_the_nf4_weights_alone(base):
    _, path = base
    model, _ = qlora_model(path, targets=["wq"])
    before = model.layers["1"].attention.wq.weight.quantized_data.clone()
    torch.manual_seed(5)
    with hide_quantized([model]):
        assert model.layers["1"].attention.wq.weight.numel() == 0
        model.init_weights()
    weight = model.layers["1"].attention.wq.weight
    assert is_quantized(weight) and torch.equal(weight.quantized_data, before)


def test_nf4_takes_about_a_quarter_of_bf16s_bytes(base):
    _, path = base
    model, _ = qlora_model(path)
    nbytes, numel = quantized_bytes([model])
    assert numel == 2 * (4 * 128 * 128 + 3 * 128 * 256)
    # 4 bits + an int8 absmax per 64 + an fp32 scale per 64·256, and per tensor the 16 fp32
    # NF4 code values and the fp32 mean of its absmaxes.
    assert nbytes == numel // 2 + numel // 64 + 4 * numel // 16384 + 14 * (16 * 4 + 4)
    assert adapted_base_bytes([model]) == nbytes
    assert adapted_base_bytes([model]) / (numel * 2) < 0.26


def test_frozen_weights_are_stored_in_the_compute_dtype():
    with torch.device("meta"):
        model = build_model(ARGS)
    apply_lora(model, Peft(method="lora", rank=4, target_modules=["wq"]))
    store_frozen_in(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16), name


def test_weights_that_cannot_be_split_into_nf4_shards_are_named():
    assert shard_problem("w", (768, 256), 2) is None
    assert shard_problem("layers.0.feed_forward.w1.weight", (704, 256), 2) == (
        "layers.0.feed_forward.w1.weight (704×256) cannot be stored as NF4 over 2 FSDP shards: "
        "its rows must split evenly and each shard must hold a multiple of 16384 weights (64·256)"
    )
    assert shard_problem("w", (96, 256), 1) is not None  # not whole blocks even unsharded


def test_bad_bases_are_one_line(base, tmp_path):
    _, path = base
    with torch.device("meta"):
        model = build_model(ARGS)
    apply_lora(model, Peft(method="lora", rank=4, target_modules=["w1"]))
    with pytest.raises(ConfigError, match=r"^peft.quantize_base=nf4: layers.0.feed_forward.w1"):
        quantize_base(model, path, shards=4)  # 256×128 = 2 blocks of 16384: not 4 shards
    other = dataclasses.replace(ARGS, hidden_dim=384)
    with torch.device("meta"):
        wider = build_model(other)
    apply_lora(wider, Peft(method="lora", rank=4, target_modules=["w1"]))
    with pytest.raises(ConfigError) as e:
        quantize_base(wider, path, shards=1)
    assert "layers.0.feed_forward.w1.weight is (256, 128), the model's is (384, 128)" in str(
        e.value
    )
    assert "\n" not in str(e.value)
    empty = tmp_path / "empty"
    with pytest.warns(UserWarning):
        dcp.save({"model": {"tok_embeddings.weight": torch.zeros(97, 128)}}, checkpoint_id=empty)
    with pytest.raises(ConfigError, match="holds no model.layers.0.feed_forward.w1.weight;"):
        quantize_base(model, str(empty), shards=1)


def test_config_needs_lora_and_a_base_checkpoint():
    with pytest.raises(ConfigError, match=r"^peft.quantize_base=nf4 needs peft.method=lora"):
        build_config(["--peft.quantize_base", "nf4"])
    with pytest.raises(ConfigError, match="needs checkpoint.initial_load_path"):
        build_config(["--peft.method", "lora", "--peft.quantize_base", "nf4"])
    cfg = build_config(["--peft.method", "lora", "--peft.quantize_base", "nf4",
                        "--checkpoint.initial_load_path", "/some/base"])  # fmt: skip
    assert cfg.peft.quantize_base == "nf4"
