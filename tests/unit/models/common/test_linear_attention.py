"""Gated DeltaNet (`common/linear_attention.py`, `common/delta_rule.py`) against Hugging Face's
`Qwen3_5GatedDeltaNet` on random weights (fp32, 1e-5), on shapes whose key and value heads
differ, with convolutions of 2 and 4 taps and sequences that are not a multiple of the 64-token
chunk; and the state a prefix leaves, carried into the rest (a prefill, then one token at a
time), against the whole sequence at once. The rule itself: test_delta_rule.py."""

from __future__ import annotations

import pytest
import torch

from titanlab.models.common.hf_hybrid import _grouped_rows
from titanlab.models.common.linear_attention import GatedDeltaNet

SHAPES = [  # (dim, key heads, value heads, key dim, value dim, taps, seq)
    (64, 2, 4, 16, 8, 4, 150),
    (48, 3, 3, 8, 16, 2, 64),
    (64, 1, 4, 32, 16, 4, 77),
    (32, 2, 2, 16, 16, 3, 5),
]


def theirs_and_ours(dim, hk, hv, dk, dv, taps, seed=0):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=dim, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=taps,
        num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(seed)
    theirs = Qwen3_5GatedDeltaNet(config, 0).float()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        theirs.A_log.copy_(torch.empty(hv).uniform_(0.5, 2.5).log())
    ours = GatedDeltaNet(dim, hk, hv, dk, dv, taps, config.rms_norm_eps)
    names = {"wqkv.weight": "in_proj_qkv.weight", "wz.weight": "in_proj_z.weight",
             "wb.weight": "in_proj_b.weight", "wa.weight": "in_proj_a.weight",
             "conv.weight": "conv1d.weight", "decay.dt_bias": "dt_bias", "decay.A_log": "A_log",
             "norm.weight": "norm.weight", "wo.weight": "out_proj.weight"}  # fmt: skip
    state = theirs.state_dict()
    mine = {ours_name: state[hf] for ours_name, hf in names.items()}
    for name in ("wqkv.weight", "conv.weight"):  # HF's [q; k; v] rows → grouped by key head
        mine[name] = _grouped_rows(mine[name], hk, dk, hv // hk * dv, to_hf=False)
    ours.load_state_dict(mine)
    return theirs, ours


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_the_layer_equals_transformers(shape):
    *dims, seq = shape
    theirs, ours = theirs_and_ours(*dims)
    x = torch.randn(2, seq, dims[0])
    with torch.no_grad():
        want = theirs(x)
        got, _ = ours.step(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_prefix_state_then_one_token_at_a_time_equals_the_whole_sequence():
    _, ours = theirs_and_ours(64, 2, 4, 16, 8, 4, seed=1)
    x = torch.randn(2, 90, 64)
    with torch.no_grad():
        whole, _ = ours.step(x)
        head, state = ours.step(x[:, :70])
        parts = [head]
        for t in range(70, 90):
            out, state = ours.step(x[:, t : t + 1], state)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_a_mutant_decay_is_caught():
    """The comparison can fail: dt_bias shifted by one (a different decay) fails it."""
    theirs, ours = theirs_and_ours(64, 2, 4, 16, 8, 4)
    with torch.no_grad():
        ours.decay.dt_bias.add_(1.0)
        x = torch.randn(2, 40, 64)
        assert (ours(x) - theirs(x)).abs().max() > 1e-3


def test_packed_documents_run_as_if_alone():
    """Documents packed in a row (lengths not multiples of the 64-token chunk, a start inside a
    chunk and one on a chunk's first token) give each document's outputs and input gradients as
    when it runs alone (fp64)."""
    _, ours = theirs_and_ours(64, 2, 4, 16, 8, 4, seed=2)
    ours = ours.double()
    lengths = [[50, 14, 86], [64, 86]]
    x = torch.randn(2, 150, 64, dtype=torch.float64, requires_grad=True)
    segments = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    packed, _ = ours.step(x, segments=segments)
    weights = torch.randn_like(packed)
    (packed * weights).sum().backward()
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            alone = x[b : b + 1, start : start + n].detach().requires_grad_()
            out, _ = ours.step(alone)
            (out * weights[b : b + 1, start : start + n]).sum().backward()
            torch.testing.assert_close(packed[b, start : start + n], out[0], atol=1e-10, rtol=0)
            torch.testing.assert_close(x.grad[b, start : start + n], alone.grad[0], atol=1e-10,
                                       rtol=0)  # fmt: skip
            start += n


def test_a_mutant_without_resets_is_caught():
    _, ours = theirs_and_ours(64, 2, 4, 16, 8, 4, seed=2)
    x = torch.randn(1, 100, 64)
    segments = torch.tensor([[0] * 40 + [1] * 60])
    with torch.no_grad():
        packed, _ = ours.step(x, segments=segments)
        alone, _ = ours.step(x[:, 40:])
        run_on, _ = ours.step(x)
    assert (packed[:, 40:] - alone).abs().max() < 1e-5
    assert (run_on[:, 40:] - alone).abs().max() > 1e-3
