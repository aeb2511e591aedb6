"""GRPO's arithmetic against hand-computed values: advantages, k3 KL, the mask by position, the
clip's zero gradient, and the token mean over ranks."""

from __future__ import annotations

import math

import pytest
import torch

from titanlab.posttrain.rl import objectives as obj

EOS = 12


def test_advantages_are_group_normalized_and_a_zero_std_group_gives_exactly_zero():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1])  # 2 groups of 4
    adv, zero_std = obj.group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.5, 0.5]).std().item()  # unbiased, as TRL and verl
    expected = [(r - 0.5) / (std + 1e-6) for r in (1.0, 0.0, 0.5, 0.5)]
    assert adv[:4].tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # exactly: no residue of the mean
    assert zero_std.tolist() == [False, True]
    # Eight rewards of 0.3: the float32 mean leaves a residue of 3e-8 and a std of 3e-8, which
    # the plain formula turns into nonzero advantages (NeMo-RL's 7428× case); the rule gives 0.
    same = torch.full((8,), 0.3)
    naive = (same - same.mean()) / (same.std() + 1e-6)
    assert naive.abs().max().item() > 0
    assert obj.group_advantages(same, 8)[0].abs().max().item() == 0.0
    unscaled, _ = obj.group_advantages(rewards, 4, scale=False)  # Dr. GRPO: r − mean
    assert unscaled[:4].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert unscaled[4:].tolist() == [0.0] * 4


def test_k3_is_nonnegative_and_zero_where_the_policies_agree():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(1000, generator=g) * 5
    ref = -torch.rand(1000, generator=g) * 5
    kl = obj.k3_kl(logp, ref)
    assert (kl >= 0).all()
    x = ref - logp
    assert kl.tolist() == pytest.approx((torch.exp(x) - x - 1).tolist(), rel=1e-5, abs=1e-7)
    assert obj.k3_kl(logp, logp).abs().max().item() == 0.0
    tiny = obj.k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0 + 1e-7]))  # exp(x)-x-1 < 0 in fp32
    assert tiny.item() >= 0.0
    assert math.isfinite(obj.k3_kl(torch.tensor([0.0]), torch.tensor([-1e4])).item())  # clamped


def test_mask_counts_up_to_the_first_eos_by_position_with_pad_equal_to_eos():
    completions = torch.tensor([[3, EOS, EOS, EOS], [3, 4, 5, 6], [EOS, 7, EOS, 1]])
    mask, truncated = obj.completion_mask(completions, EOS)
    assert mask.tolist() == [
        [True, True, False, False],  # the first EOS counts, the padding EOS after it does not
        [True, True, True, True],
        [True, False, False, False],  # nothing after the first EOS, whatever its ids
    ]
    assert truncated.tolist() == [False, True, False]


def test_tokens_after_eos_get_no_gradient_even_when_their_values_are_not_finite():
    completions = torch.tensor([[3, EOS, EOS], [EOS, 5, 6]])
    mask, _ = obj.completion_mask(completions, EOS)
    logp = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("nan"), -3.0]],
                        requires_grad=True)  # fmt: skip
    per_token, _ = obj.clipped_surrogate(logp, logp.detach(), torch.tensor([1.0, -2.0]), 0.2, 0.2)
    loss = obj.aggregate_sum(per_token + 0.1 * obj.k3_kl(logp, torch.zeros(2, 3)), mask, False)
    loss.backward()
    assert math.isfinite(loss.item())
    grad = logp.grad
    assert grad is not None
    assert grad[0, 2].item() == 0.0 and grad[1, 1].item() == 0.0 and grad[1, 2].item() == 0.0
    assert grad[0, 0].item() != 0.0 and grad[1, 0].item() != 0.0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_the_clip_removes_the_gradient_only_on_the_advantages_side(advantage):
    # ratios 1.5 (above 1 + 0.2) and 0.5 (below 1 - 0.2), and 1.1 inside the range
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_(True)
    per_token, ratio = obj.clipped_surrogate(logp, old, torch.tensor([advantage]), 0.2, 0.2)
    per_token.sum().backward()
    grad = logp.grad
    assert grad is not None
    # d/dlogp of −ρ·Â is −ρ·Â where the clip does not bind
    if advantage > 0:  # above 1 + ε is clipped (no push further up); below is not
        assert grad[0].tolist() == pytest.approx([0.0, -0.5, -1.1])
    else:  # below 1 − ε is clipped (no push further down); above is not
        assert grad[0].tolist() == pytest.approx([1.5, 0.0, 1.1])
    low, high = obj.clip_fractions(
        ratio, torch.tensor([advantage]), torch.ones(1, 3, dtype=torch.bool), 0.2, 0.2
    )
    assert (low.item(), high.item()) == ((0.0, 1.0) if advantage > 0 else (1.0, 0.0))


def test_clip_higher_widens_only_the_upper_range():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.25]])).requires_grad_(True)
    per_token, _ = obj.clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    per_token.sum().backward()
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-1.25)  # inside 1.28


def test_token_mean_over_ranks_equals_one_process():
    """Each rank divides its token sum by the global token count; the sum over ranks is the one
    process's token mean (and not the mean of the ranks' means, which weighs short batches
    more)."""
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(8, 5, generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 5, 4, 1])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    whole = obj.aggregate_sum(per_token, mask, False) / mask.sum()
    halves = [(per_token[i : i + 4], mask[i : i + 4]) for i in (0, 4)]
    split = sum(obj.aggregate_sum(p, m, False) for p, m in halves) / mask.sum()
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)
    mean_of_means = sum(obj.aggregate_sum(p, m, False) / m.sum() for p, m in halves) / 2
    assert abs(mean_of_means.item() - whole.item()) > 1e-3
    # sequence mean: Σ of each completion's token mean ÷ completions
    seq = obj.aggregate_sum(per_token, mask, True) / 8
    by_hand = sum(per_token[i, : lengths[i]].mean() for i in range(8)) / 8
    assert seq.item() == pytest.approx(by_hand.item(), abs=1e-6)


def test_token_logprobs_use_the_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    lp = obj.token_logprobs(logits, torch.tensor([[0]]), 0.5)
    assert lp.item() == pytest.approx(torch.log_softmax(logits[0, 0] / 0.5, -1)[0].item())
