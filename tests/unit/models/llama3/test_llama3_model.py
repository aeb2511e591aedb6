"""Transformer: shapes, meta-device init, weight tying, pipeline-stage slices, imports."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import titanlab.models.llama3.model as model_module
from titanlab.models.llama3 import Transformer, llama3_flavors


def debug_args(**kw):
    return dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=128, max_seq_len=16, **kw)


def small_args(**kw):
    base = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, vocab_size=512, max_seq_len=16
    )
    return dataclasses.replace(llama3_flavors["debugmodel"], **{**base, **kw})


def build_on_meta_and_init(args, seed=0):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_debugmodel_forward_shape_and_dtype():
    args = debug_args()
    model = build_on_meta_and_init(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, args.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.rope_cos.shape == (16, 16) and "rope_cos" not in model.state_dict()


def test_init_after_to_empty_is_deterministic():
    args = small_args()
    a, b = build_on_meta_and_init(args, seed=3), build_on_meta_and_init(args, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = build_on_meta_and_init(args, seed=4)
    assert not torch.equal(c.layers["0"].attention.wq.weight, sa["layers.0.attention.wq.weight"])
    ref_cos = Transformer(args).rope_cos  # built directly on CPU
    torch.testing.assert_close(a.rope_cos, ref_cos, atol=0, rtol=0)


def test_init_stds():
    args = small_args(n_layers=2)
    model = build_on_meta_and_init(args)
    trunc3 = 0.9866  # std of a normal truncated at +-3 sigma, in units of sigma

    def close(t, std):
        return math.isclose(t.std().item(), std, rel_tol=0.1)

    assert close(model.tok_embeddings.weight, 1.0)
    layer0, layer1 = model.layers["0"], model.layers["1"]
    assert close(layer0.attention.wq.weight, 0.02 * trunc3)
    assert close(layer0.feed_forward.w1.weight, 0.02 * trunc3)
    assert close(layer0.attention.wo.weight, 0.02 / math.sqrt(2) * trunc3)
    assert close(layer1.feed_forward.w2.weight, 0.02 / math.sqrt(4) * trunc3)
    assert close(model.output.weight, args.dim**-0.5 * trunc3)
    assert model.output.weight.abs().max() <= 3 * args.dim**-0.5
    assert torch.equal(layer0.attention_norm.weight, torch.ones(args.dim))
    flat = build_on_meta_and_init(small_args(depth_init=False))
    assert close(flat.layers["0"].attention.wo.weight, 0.02 / math.sqrt(2 * 2) * trunc3)


def test_tied_embeddings_share_the_parameter():
    args = small_args(tie_word_embeddings=True)
    model = build_on_meta_and_init(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())  # counted once
    assert math.isclose(model.output.weight.std().item(), args.dim**-0.5 * 0.9866, rel_tol=0.1)
    model(torch.randint(0, args.vocab_size, (1, 4))).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_pipeline_stage_slice_takes_and_returns_hidden_states():
    args = small_args(n_layers=4)
    full = build_on_meta_and_init(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    # Reference: hidden state after layers 0..1 of the full model, then layers 2..3.
    h0 = full.tok_embeddings(tokens)
    cos, sin = full.rope_cos[:8], full.rope_sin[:8]
    for i in ("0", "1"):
        h0 = full.layers[i](h0, cos, sin)
    h_expected = h0
    for i in ("2", "3"):
        h_expected = full.layers[i](h_expected, cos, sin)

    middle = build_on_meta_and_init(args)
    middle.load_state_dict(full.state_dict())
    middle.tok_embeddings, middle.norm, middle.output = None, None, None
    del middle.layers["0"], middle.layers["1"]
    middle.init_weights()  # must tolerate the missing modules
    middle.load_state_dict(full.state_dict(), strict=False)
    out = middle(h0)
    assert out.shape == (2, 8, args.dim)
    torch.testing.assert_close(out, h_expected, atol=1e-6, rtol=0)


def test_seq_longer_than_rope_table_raises():
    model = build_on_meta_and_init(small_args(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bf16_forward_returns_compute_dtype():
    model = build_on_meta_and_init(small_args()).to(torch.bfloat16)
    assert model(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_model_file_imports_nothing_distributed():
    source = Path(model_module.__file__).read_text()
    assert "torch.distributed" not in source
    assert "import distributed" not in source
