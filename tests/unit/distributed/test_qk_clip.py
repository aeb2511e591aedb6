"""MuonClip's QK-clip (titanlab.distributed.qk_clip): the recorded logit maxima, the rescaling of
the heads over τ (and of no other), and the refusals."""

import dataclasses
import math
import re

import pytest
import torch

from titanlab.distributed import qk_clip
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.models.common.logit_max import max_logits
from titanlab.models.registry import build_model, get_family


def _brute(q, k, allowed):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("chunk", [1 << 24, 7])  # one chunk, or query chunks of a few rows
def test_max_logits_equal_the_masked_scores_max(chunk, monkeypatch):
    monkeypatch.setattr("titanlab.models.common.logit_max.CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(max_logits(q, k), _brute(q, k, causal), rtol=0, atol=1e-6)
    docs = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    docs |= torch.eye(5, dtype=torch.bool)  # each query sees at least itself
    torch.testing.assert_close(max_logits(q, k, docs), _brute(q, k, docs), rtol=0, atol=1e-6)
    # FlexAttention's block masks (the CUDA path): documents and a window, row chunk by chunk
    from titanlab.models.common.flex_masks import document_block_mask

    seg = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    pos = torch.arange(5).expand(2, 5)
    block = document_block_mask(seg, pos, seg, pos, window=2)
    rule = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
    rule &= pos[:, :, None] - pos[:, None, :] < 2
    torch.testing.assert_close(max_logits(q, k, block), _brute(q, k, rule[:, None]), rtol=0,
                               atol=1e-6)  # fmt: skip


def _model(kv_heads: int) -> torch.nn.Module:
    args = get_family("llama3").flavors["debugmodel"]
    args = dataclasses.replace(args, vocab_size=64, max_seq_len=16, n_kv_heads=kv_heads)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


def _recorded(model, tokens) -> torch.Tensor:
    """(layers, heads) maxima of one forward."""
    qk_clip.reset([model])
    with torch.no_grad():
        model(tokens)
    return torch.stack([a.max_logit for _, a in qk_clip.attention_layers(model)])


@pytest.mark.parametrize("kv_heads", [None, 4])  # multi-head, and grouped (4 heads per key)
def test_a_head_over_tau_falls_back_to_tau_and_no_other_logit_moves(kv_heads):
    model = _model(kv_heads)
    attn = model.layers["1"].attention
    hd, hot = attn.head_dim, 5
    with torch.no_grad():  # head 5 of layer 1 far sharper than every other head
        attn.wq.weight[hot * hd : (hot + 1) * hd] *= 40
    qk_clip.install([model])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _recorded(model, tokens)
    others = before.clone()
    others[1, hot] = float("-inf")
    tau = float(before[1, hot]) / 3
    assert others.max() < tau < before[1, hot]  # only that head is over τ
    wq_before = attn.wq.weight.detach().clone()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    _recorded(model, tokens)
    metrics = qk_clip.clip([model], tau, n_layers=len(model.layers))
    assert metrics["qk_clip/clipped_heads"] == 1
    assert metrics["qk_clip/layer.1/max_logit"] == before[1, hot]
    assert metrics["qk_clip/max_logit"] == before.max()

    after = _recorded(model, tokens)
    assert abs(after[1, hot] - tau) <= 1e-5 * tau  # back to τ, within rounding
    # No other head of layers 0 and 1 moved (later layers see layer 1's new output).
    mask = torch.ones_like(after[:2], dtype=torch.bool)
    mask[1, hot] = False
    torch.testing.assert_close(after[:2][mask], before[:2][mask], rtol=1e-5, atol=0)
    rows = slice(hot * hd, (hot + 1) * hd)
    gamma = tau / float(before[1, hot])
    if kv_heads is None:  # MHA: that head's q and k rows × √γ, every other weight untouched
        torch.testing.assert_close(attn.wq.weight[rows], wq_before[rows] * math.sqrt(gamma))
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
        assert changed == {"layers.1.attention.wq.weight", "layers.1.attention.wk.weight"}
        for name in changed:
            untouched = torch.ones(weights[name].shape[0], dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(dict(model.named_parameters())[name][untouched],
                               weights[name][untouched])  # fmt: skip
    else:  # GQA: the shared key head × √γ, head 5's query × √γ, its siblings' × 1/√γ
        torch.testing.assert_close(attn.wq.weight[rows], wq_before[rows] * math.sqrt(gamma))
        sibling = slice(4 * hd, 5 * hd)  # head 4 shares key head 1 with heads 5, 6, 7
        torch.testing.assert_close(attn.wq.weight[sibling], wq_before[sibling] / math.sqrt(gamma))


def test_mla_head_over_tau_scales_its_nope_rows_by_root_gamma_and_rope_rows_by_gamma():
    """Kimi K2's rule for multi-head latent attention: q_C and k_C × √γ, q_R × γ, the shared
    k_R (wkv_a) and the values untouched; the head's logit falls back to τ."""
    args = get_family("deepseek_v3").flavors["debugmodel"]
    args = dataclasses.replace(args, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    attn = model.layers["1"].attention
    wq = attn.wq if attn.wq is not None else attn.wq_b
    hot, per_head = 1, attn.qk_head_dim
    with torch.no_grad():
        wq.weight[hot * per_head : (hot + 1) * per_head] *= 30
    qk_clip.install([model])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _recorded(model, tokens)
    tau = float(before[1, hot]) / 3
    others = before[:2].clone()
    others[1, hot] = float("-inf")
    assert others.max() < tau
    q0, kv_b0, kv_a0 = wq.weight.clone(), attn.wkv_b.weight.clone(), attn.wkv_a.weight.clone()
    _recorded(model, tokens)
    qk_clip.clip([model], tau, n_layers=len(model.layers))
    after = _recorded(model, tokens)
    assert abs(after[1, hot] - tau) <= 1e-5 * tau
    mask = torch.ones_like(after[:2], dtype=torch.bool)
    mask[1, hot] = False
    torch.testing.assert_close(after[:2][mask], before[:2][mask], rtol=1e-5, atol=0)
    gamma = tau / float(before[1, hot])
    nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    start = hot * per_head
    torch.testing.assert_close(
        wq.weight[start : start + nope], q0[start : start + nope] * gamma**0.5
    )
    torch.testing.assert_close(wq.weight[start + nope : start + nope + rope],
                               q0[start + nope : start + nope + rope] * gamma)  # fmt: skip
    kv_head = nope + attn.v_head_dim
    start = hot * kv_head
    torch.testing.assert_close(attn.wkv_b.weight[start : start + nope],
                               kv_b0[start : start + nope] * gamma**0.5)  # fmt: skip
    assert torch.equal(attn.wkv_b.weight[start + nope : start + kv_head],
                       kv_b0[start + nope : start + kv_head])  # the values  # fmt: skip
    assert torch.equal(attn.wkv_a.weight, kv_a0)  # the shared rotary key
    untouched = torch.ones(q0.shape[0], dtype=torch.bool)
    untouched[hot * per_head : (hot + 1) * per_head] = False
    assert torch.equal(wq.weight[untouched], q0[untouched])


def _config(*args: str) -> JobConfig:
    from titanlab.config.manager import build_config

    return build_config(list(args))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--optimizer.qk_clip_threshold", "0"], "must be > 0 (or -1: off)"),
        (["--optimizer.qk_clip_threshold", "-3"], "must be > 0 (or -1: off)"),
    ],
)
def test_threshold_out_of_range_is_one_line(args, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _config(*args)


@pytest.mark.parametrize(
    "args, qk_norm, words",
    [
        (["--model.name", "qwen3"], True, "QK-norm"),
        (["--parallelism.context_parallel_degree", "2"], False, "context_parallel"),
        (["--parallelism.tensor_parallel_mode", "2d"], False, "tensor_parallel_mode=2d"),
        (["--peft.method", "lora"], False, "peft.method=lora"),
        (
            ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
            False,
            "activation_checkpoint.mode=full",
        ),
    ],
)
def test_what_qk_clip_does_not_take_is_refused_in_one_line(args, qk_norm, words):
    config = _config("--optimizer.qk_clip_threshold", "50", *args)
    with pytest.raises(ConfigError) as e:
        qk_clip.check_qk_clip(config, qk_norm)
    assert words in str(e.value) and "optimizer.qk_clip_threshold=50" in str(e.value)
    assert "\n" not in str(e.value)
