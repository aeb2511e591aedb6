"""DeepSeek-V3's sequence-wise balance loss (arXiv:2412.19437, eqs. 17-20): the MoE layer's value
equals the formula written out per sequence, differs from the global loss when the sequences
route differently, and its injected gradient equals the gradient of coefficient × the loss."""

import itertools

import pytest
import torch

from titanlab.models.common.moe import MoE, MoEArgs

DIM, E, K = 16, 8, 2


def _layer(score_func: str, kind: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        DIM,
        MoEArgs(num_experts=E, top_k=K, hidden_dim=12, score_func=score_func,
                load_balance_coeff=0.5, load_balance_type=kind),
    )  # fmt: skip
    moe.init_weights(0.05)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
    return moe.train()


def written_out(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Σ_i f_i P_i per sequence, averaged over the sequences, from the router's own choices."""
    bs, seq, _ = x.shape
    losses = []
    for b in range(bs):
        _, experts, scores = moe.router(x[b], None)  # (seq, k), (seq, E)
        f = torch.stack([(experts == i).any(-1).float().sum() for i in range(E)])
        f = f * E / (K * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append((f * p).sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_value_is_the_per_sequence_formula_and_not_the_global_loss(score_func):
    x = torch.randn(3, 10, DIM)
    x[1] += 2.0  # a sequence that routes unlike the others
    moe = _layer(score_func, "sequence")
    moe(x)
    want = written_out(moe, x)
    assert moe.last_aux is not None
    torch.testing.assert_close(moe.last_aux, want, rtol=1e-6, atol=0)
    global_moe = _layer(score_func, "global")
    global_moe(x)
    assert global_moe.last_aux is not None
    print(f"{score_func}: sequence-wise {want.item():.5f}, global {global_moe.last_aux.item():.5f}")
    assert abs(global_moe.last_aux.item() / K - want.item()) > 1e-3  # different losses


@pytest.mark.parametrize(("score_func", "scale"), itertools.product(["sigmoid", "softmax"], [0.3]))
def test_injected_gradient_is_the_loss_gradient(score_func, scale):
    x = torch.randn(3, 10, DIM)
    injected = _layer(score_func, "sequence")
    injected.aux_grad_scale = scale
    g = torch.randn(3, 10, DIM)
    (injected(x) * g).sum().backward()
    explicit = _layer(score_func, "sequence")
    ((explicit(x) * g).sum() + scale * written_out(explicit, x)).backward()
    for (name, a), (_, b) in zip(
        injected.named_parameters(), explicit.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert injected.router.gate.weight.grad.abs().sum() > 0
