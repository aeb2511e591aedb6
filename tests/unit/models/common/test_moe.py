"""The MoE layer against naive references: routing, dispatch/combine, grouped GEMM, balancing."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titanlab.config.device_path import Target, code_path_of
from titanlab.models.common.moe import MoE, MoEArgs

DIM = 16


def make(seed: int = 0, **change) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(**{"num_experts": 6, "top_k": 2, "hidden_dim": 12, **change})
    moe = MoE(DIM, args)
    moe.init_weights(0.05)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)  # spread the scores: distinct top-k choices
    return moe


def naive_routing(moe: MoE, x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Per token, in plain Python: the k best experts and their weights."""
    a = moe.args
    chosen, weights = [], []
    for row in x:
        logits = [float((row.double() * w.double()).sum()) for w in moe.router.gate.weight]
        if a.score_func == "softmax":
            m = max(logits)
            exps = [torch.tensor(v - m).exp().item() for v in logits]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + torch.tensor(-v).exp().item()) for v in logits]
        bias = moe.expert_bias.tolist() if moe.expert_bias is not None else [0.0] * len(scores)
        best = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias[e]))[: a.top_k]
        w = [scores[e] for e in best]
        if a.route_norm:
            w = [v / sum(w) for v in w]
        chosen.append(sorted(best))
        weights.append([w[best.index(e)] * a.route_scale for e in sorted(best)])
    return chosen, weights


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"score_func": "sigmoid", "route_norm": False, "route_scale": 2.5},
        {"bias_update_speed": 0.01},
    ],
    ids=["softmax_norm", "sigmoid_scaled", "with_bias"],
)
def test_routing_picks_the_naive_experts_and_weights(change):
    moe = make(**change)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 6))  # a bias that changes the choice
    x = torch.randn(40, DIM)
    weights, experts, _ = moe.router(x, moe.expert_bias)
    want_experts, want_weights = naive_routing(moe, x)
    order = experts.sort(-1)
    assert order.values.tolist() == want_experts
    got = weights.gather(-1, order.indices)
    assert torch.allclose(got.double(), torch.tensor(want_weights, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("shared", [0, 1])
def test_every_token_equals_the_dense_computation_through_its_experts(shared):
    moe = make(num_shared_experts=shared)
    x = torch.randn(3, 7, DIM)
    out = moe(x)
    flat = x.reshape(-1, DIM)
    weights, experts, _ = moe.router(flat, None)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):  # no token dropped: each gets all k of its experts
        for slot in range(moe.args.top_k):
            e = experts[t, slot]
            h = F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])
            want[t] += weights[t, slot] * (w2[e] @ h)
        if moe.shared_experts is not None:
            want[t] += moe.shared_experts(flat[t : t + 1])[0]
    assert torch.allclose(out.reshape(-1, DIM), want, atol=1e-5)
    assert moe.tokens_per_expert.sum().item() == flat.shape[0] * moe.args.top_k


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing")
def test_grouped_gemm_path_equals_the_loop():
    moe = make()
    x = torch.randn(2, 9, DIM, requires_grad=True)
    grad = torch.randn(2, 9, DIM)
    results = []
    for grouped in (False, True):
        moe.experts.use_grouped_mm = grouped
        moe.zero_grad()
        x.grad = None
        out = moe(x)
        out.backward(grad)
        results.append((out.detach(), x.grad.clone(), moe.experts.w1.grad.clone()))
    (o1, gx1, gw1), (o2, gx2, gw2) = results
    assert torch.allclose(o1, o2, atol=1e-6)
    assert torch.allclose(gx1, gx2, atol=1e-6) and torch.allclose(gw1, gw2, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing")
def test_one_device_under_autocast_takes_the_grouped_gemm_in_bf16():
    # One GPU without FSDP trains under autocast with fp32 activations: the experts cast to
    # autocast's bf16 for the grouped GEMM, where they took the per-expert loop (a host sync).
    moe = make(hidden_dim=16)  # bf16 grouped GEMMs want rows of 16-byte multiples
    x = torch.randn(2, 9, DIM)
    calls = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loop = moe(x)  # this CPU: the loop, its matmuls in bf16 by autocast
        with code_path_of(Target("cuda", (9, 0))), _Spy(calls):
            grouped = moe(x)
    assert calls and all(dtype == torch.bfloat16 for dtype in calls)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=0.02, rtol=0.02)


class _Spy(TorchDispatchMode):
    """The input dtype of every `_grouped_mm` called in the block."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.calls.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_load_balance_loss_and_its_gradient():
    """aux = E · Σ f_i P_i (Switch Transformer); its gradient reaches the router through the
    injected term, scaled by aux_grad_scale."""
    moe = make(load_balance_coeff=0.01)
    x = torch.randn(5, 8, DIM)
    out = moe(x)
    _, experts, scores = moe.router(x.reshape(-1, DIM), None)
    f = torch.bincount(experts.flatten(), minlength=6).float() / scores.shape[0]
    want = 6 * (f * scores.mean(0)).sum()
    assert moe.last_aux is not None and torch.allclose(moe.last_aux, want.detach(), atol=1e-6)
    # No gradient through the aux term unless the trainer sets a scale.
    out.sum().backward()
    base = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    ref = make(load_balance_coeff=0.01)  # the same weights: the aux term's gradient alone
    (3.0 * 6 * (f * ref.router(x.reshape(-1, DIM), None)[2].mean(0)).sum()).backward()
    moe.aux_grad_scale = 3.0
    moe(x).sum().backward()
    assert torch.allclose(
        moe.router.gate.weight.grad - base, ref.router.gate.weight.grad, atol=1e-6
    )


def test_expert_bias_moves_toward_the_mean_load():
    moe = make(bias_update_speed=0.1)
    moe(torch.randn(1, 4, DIM))
    moe.end_step(torch.tensor([10.0, 0, 5, 5, 5, 5]))
    assert moe.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0, 0, 0, 0])
    assert moe.tokens_per_expert.sum() == 0 and moe.step_load.tolist()[0] == 10


def test_bad_args_are_one_line():
    with pytest.raises(ValueError, match=r"top_k=9 must be in 1..num_experts \(6\)"):
        MoEArgs(num_experts=6, top_k=9).validate()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoint_recompute_counts_tokens_once(reentrant):
    from torch.utils.checkpoint import checkpoint

    moe = make(load_balance_coeff=0.01)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    checkpoint(moe, x, use_reentrant=reentrant).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 10 * moe.args.top_k  # not twice
    once = moe.step_aux.item()
    plain = make(load_balance_coeff=0.01)
    plain(x.detach())
    assert once == pytest.approx(plain.step_aux.item(), abs=1e-7)


def test_paused_forwards_record_nothing():
    from titanlab.distributed.moe_stats import stats_paused

    moe = make(load_balance_coeff=0.01)
    with stats_paused(moe):
        moe(torch.randn(1, 4, DIM))
    assert moe.tokens_per_expert.sum() == 0 and moe.step_aux == 0 and moe.record_stats
