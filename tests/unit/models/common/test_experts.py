"""The routed experts' token groups padded to a multiple of 16 rows (`pad_groups`, what float8's
grouped GEMM needs): the same outputs and gradients as without padding."""

import pytest
import torch

from titanlab.models.common.experts import GroupedExperts, pad_groups


@pytest.mark.parametrize("counts", [[5, 0, 16, 3], [0, 0, 0, 7], [16, 32, 0, 1], [0, 0, 0, 0]])
def test_pad_groups_places_every_row_in_its_experts_padded_group(counts):
    counts_t = torch.tensor(counts)
    x = torch.randn(int(counts_t.sum()), 8)
    padded, padded_counts, rows = pad_groups(x, counts_t, 16)
    assert padded.shape[0] == -(-(x.shape[0] + 4 * 15) // 16) * 16
    assert padded_counts.tolist() == [-(-c // 16) * 16 for c in counts]
    assert int(padded_counts.sum()) <= padded.shape[0]
    torch.testing.assert_close(padded[rows], x, rtol=0, atol=0)
    # each row lands inside its expert's padded group, in order, the rest is zeros
    starts = padded_counts.cumsum(0) - padded_counts
    expert = torch.repeat_interleave(torch.arange(4), counts_t)
    first = torch.cat([torch.arange(c) for c in counts]).long() if x.shape[0] else rows
    assert torch.equal(rows, starts[expert] + first)
    rest = torch.ones(padded.shape[0], dtype=torch.bool)
    rest[rows] = False
    assert padded[rest].abs().sum() == 0


def test_padded_grouped_experts_equal_the_unpadded_ones_with_their_gradients():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=4)
    experts.init_weights(0.02)
    experts.use_grouped_mm = True  # torch._grouped_mm runs on the CPU too
    counts = torch.tensor([7, 0, 20, 5])
    x = torch.randn(32, 16, requires_grad=True)
    results = []
    for multiple in (1, 16):
        experts.group_multiple = multiple
        experts.zero_grad()
        x.grad = None
        out = experts(x, counts)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad.clone(), experts.w1.grad.clone()))
    for plain, padded in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=1e-6, atol=1e-6)
