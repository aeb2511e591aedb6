"""Self-speculative decoding with DeepSeek-V3's MTP depth (`titanlab.generation.mtp_draft`):
the output equals plain decoding token for token (greedy, and sampled with the same seed), on a
left-padded batch whose sequences end at different steps; a draft that is always right halves
the main model's forwards, one that is always wrong costs none of the output."""

import dataclasses

import pytest
import torch

from titanlab.generation import DraftStats, SamplingParams, generate
from titanlab.generation import mtp_draft
from titanlab.models.deepseek_v3 import deepseek_v3_flavors
from titanlab.models.registry import build_model

PROMPTS = [[5, 17, 2, 40, 33], [7, 1, 9, 60, 3, 8, 22, 90, 11], [64, 4, 70]]
NEW = 11


@pytest.fixture(scope="module")
def model():
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=97, max_seq_len=64)
    torch.manual_seed(0)
    m = build_model(args)
    m.init_weights()
    return m.eval()


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(0.9, 20, 0.95)], ids=["greedy", "sampled"]
)
def test_drafting_with_the_mtp_depth_gives_the_plain_output(model, params):
    want_logits: list[torch.Tensor] = []
    want = generate(model, PROMPTS, NEW, params=params, seed=3, step_logits=want_logits)
    stats = DraftStats()
    got_logits: list[torch.Tensor] = []
    got = generate(
        model, PROMPTS, NEW, params=params, seed=3, step_logits=got_logits, mtp_draft=stats
    )
    assert got == want
    assert len(got_logits) == len(want_logits) == NEW
    worst = max((g - w).abs().max().item() for g, w in zip(got_logits, want_logits))
    print(
        f"{'greedy' if params.temperature == 0 else 'sampled'}: {stats.drafted} drafts, "
        f"{stats.accepted} accepted; {stats.forwards} forwards for {stats.emitted} tokens; "
        f"logits within {worst:.2g}"
    )
    assert worst < 1e-4  # a 2-token forward against 1-token ones, fp32
    assert stats.emitted == NEW and stats.drafted > 0
    assert stats.forwards == NEW - 1 - stats.accepted  # each accepted draft saves a forward


def _scripted(answers: list[list[int]], right: bool):
    """A draft function that knows each sequence's output (right, or one token off)."""

    def draft(model, h, index):
        tokens = [seq[index] if index < len(seq) else 0 for seq in answers]
        return torch.tensor([t if right else (t + 1) % 97 for t in tokens])

    return draft


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_scripted_drafts_accept_or_reject_every_time(model, monkeypatch, right):
    want = generate(model, PROMPTS, NEW)
    monkeypatch.setattr(mtp_draft, "draft_tokens", _scripted(want, right))
    stats = DraftStats()
    assert generate(model, PROMPTS, NEW, mtp_draft=stats) == want
    print(f"right={right}: {stats}")
    if right:
        assert stats.accepted == stats.drafted and stats.forwards == NEW // 2
    else:
        assert stats.accepted == 0 and stats.forwards == NEW - 1


def test_sequences_that_end_early_do_not_block_acceptance(model, monkeypatch):
    """The second sequence ends at its 4th token (its EOS); the others' right drafts are still
    accepted after that, and every output stops where plain decoding's does."""
    plain = generate(model, PROMPTS, NEW)
    eos = plain[1][3]
    want = generate(model, PROMPTS, NEW, eos_ids=[eos])
    assert len(want[1]) <= 4 < len(max(want, key=len))
    monkeypatch.setattr(mtp_draft, "draft_tokens", _scripted(plain, True))
    stats = DraftStats()
    assert generate(model, PROMPTS, NEW, eos_ids=[eos], mtp_draft=stats) == want
    assert stats.accepted == stats.drafted > 0


def test_drafting_needs_mtp_depths():
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel_deep"], vocab_size=97)
    dense = build_model(args).eval()
    with pytest.raises(ValueError, match="has none: decode without the draft"):
        generate(dense, PROMPTS, 4, mtp_draft=DraftStats())
