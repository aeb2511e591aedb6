"""Group-limited routing and the always-on expert bias (DeepSeek-V3) against transformers'
`DeepseekV3TopkRouter` / `DeepseekV3MoE`, and the one-line refusals of `MoEArgs.validate`."""

import itertools

import pytest
import torch

from titanlab.models.common.moe import MoE, MoEArgs, Router

DIM, E, HIDDEN = 64, 16, 24

# (n_groups, topk_groups, top_k): the design's shape first, then a wider and a one-group pick.
GROUPINGS = [(4, 2, 4), (8, 3, 6), (2, 1, 8)]


def hf_config(norm: bool, n_group: int, topk_group: int, top_k: int, **extra):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        hidden_size=DIM,
        n_routed_experts=E,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
        moe_intermediate_size=HIDDEN,
        experts_implementation="eager",
        **extra,
    )


def hf_router(cfg, seed: int):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(seed)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.15)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(E))
    return router


def titanlab_args(norm: bool, n_group: int, topk_group: int, top_k: int, **change) -> MoEArgs:
    return MoEArgs(
        **{
            "num_experts": E,
            "top_k": top_k,
            "hidden_dim": HIDDEN,
            "score_func": "sigmoid",
            "route_norm": norm,
            "route_scale": 2.5,
            "n_groups": n_group,
            "topk_groups": topk_group,
            "route_bias": True,
            **change,
        }
    )


def assert_same_routing(
    experts: torch.Tensor,
    weights: torch.Tensor,
    ref_experts: torch.Tensor,
    ref_weights: torch.Tensor,
) -> None:
    """Per token: the same set of experts, and each expert's weight within 1e-6."""
    mine, theirs = experts.sort(-1), ref_experts.sort(-1)
    assert torch.equal(mine.values, theirs.values)
    got = weights.gather(-1, mine.indices)
    want = ref_weights.gather(-1, theirs.indices)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(tokens,) bool: whether each token chose the same experts in `a` and `b`."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


@pytest.mark.parametrize(
    "norm,grouping,seed", list(itertools.product([True, False], GROUPINGS, [0, 1]))
)
def test_router_matches_deepseek_v3(norm, grouping, seed):
    cfg = hf_config(norm, *grouping)
    ref = hf_router(cfg, seed)
    router = Router(DIM, titanlab_args(norm, *grouping))
    with torch.no_grad():
        router.gate.weight.copy_(ref.weight)
    x = torch.randn(300, DIM)
    bias = ref.e_score_correction_bias
    _, ref_weights, ref_experts = ref(x)
    weights, experts, scores = router(x, bias)
    assert_same_routing(experts, weights, ref_experts, ref_weights)
    if norm:
        assert torch.allclose(weights.sum(-1), torch.full((300,), 2.5), atol=1e-5)
    # The cases are not vacuous: the bias changes some token's choice, and the group limit
    # keeps some token from its plain top-k.
    _, unbiased = router(x, None)[:2]
    assert not same_sets(experts, unbiased).all()
    plain = (scores + bias).topk(grouping[2], dim=-1).indices
    assert not same_sets(experts, plain).all()


@pytest.mark.parametrize("norm,with_bias", list(itertools.product([True, False], [True, False])))
def test_one_group_is_plain_topk(norm, with_bias):
    cfg = hf_config(norm, 1, 1, 4)
    ref = hf_router(cfg, 3)
    if not with_bias:
        ref.e_score_correction_bias.zero_()
    router = Router(DIM, titanlab_args(norm, 1, 1, 4))
    with torch.no_grad():
        router.gate.weight.copy_(ref.weight)
    x = torch.randn(200, DIM)
    bias = ref.e_score_correction_bias
    weights, experts, scores = router(x, bias)
    _, ref_weights, ref_experts = ref(x)
    assert_same_routing(experts, weights, ref_experts, ref_weights)
    plain = (scores + bias).topk(4, dim=-1).indices
    assert same_sets(experts, plain).all()


@pytest.mark.parametrize(
    "n_groups,score_func", list(itertools.product([2, 4, 8], ["softmax", "sigmoid"]))
)
def test_keeping_every_group_equals_one_group(n_groups, score_func):
    torch.manual_seed(n_groups)
    one = Router(DIM, titanlab_args(True, 1, 1, 4, score_func=score_func))
    many = Router(DIM, titanlab_args(True, n_groups, n_groups, 4, score_func=score_func))
    many.load_state_dict(one.state_dict())
    x, bias = torch.randn(100, DIM), 0.1 * torch.randn(E)
    w1, e1, s1 = one(x, bias)
    w2, e2, s2 = many(x, bias)
    assert torch.equal(s1, s2)
    assert_same_routing(e2, w2, e1, w1)


@pytest.mark.parametrize("route_norm,seed", list(itertools.product([True, False], [0, 1, 2])))
def test_softmax_routing_is_bitwise_the_plain_division(route_norm, seed):
    """qwen3_moe's numbers stay today's: the renormalization is a plain division (no
    `+ 1e-20` as transformers' DeepSeek-V3 has), even where a bias chooses experts whose
    softmax scores sum below 2^-42 (the large gate and bias here make such tokens)."""
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, top_k=4, hidden_dim=HIDDEN, route_norm=route_norm)
    router = Router(DIM, args)
    with torch.no_grad():
        router.gate.weight.normal_(0, 2.0)
    x, bias = 3 * torch.randn(500, DIM), torch.linspace(-0.5, 0.5, E)
    for b in (None, bias):
        weights, _, scores = router(x, b)
        choose = scores if b is None else scores + b
        want = scores.gather(-1, choose.topk(4, dim=-1).indices)
        if route_norm:
            want = want / want.sum(-1, keepdim=True)
        assert torch.equal(weights, want)


def copy_into_titanlab(moe: MoE, ref) -> None:
    """DeepseekV3MoE's weights into titanlab's layout: the fused gate_up_proj (E, 2I, d) is
    [w1; w3] per expert, down_proj (E, d, I) is w2; the shared MLP is one SwiGLU of width S·I."""
    sd = ref.state_dict()
    gate_up = sd["experts.gate_up_proj"]
    moe.load_state_dict(
        {
            "router.gate.weight": sd["gate.weight"],
            "expert_bias": sd["gate.e_score_correction_bias"],
            "experts.w1": gate_up[:, :HIDDEN],
            "experts.w3": gate_up[:, HIDDEN:],
            "experts.w2": sd["experts.down_proj"],
            "shared_experts.w1.weight": sd["shared_experts.gate_proj.weight"],
            "shared_experts.w3.weight": sd["shared_experts.up_proj.weight"],
            "shared_experts.w2.weight": sd["shared_experts.down_proj.weight"],
        }
    )


@pytest.mark.parametrize("norm,seed", list(itertools.product([True, False], [0, 1])))
def test_moe_matches_deepseek_v3_moe(norm, seed):
    cfg = hf_config(norm, 4, 2, 4, n_shared_experts=2)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    ref = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(0, 0.15 if name == "gate.weight" else 0.1)
        ref.gate.e_score_correction_bias.copy_(0.1 * torch.randn(E))
    moe = MoE(DIM, titanlab_args(norm, 4, 2, 4, num_shared_experts=2))
    assert moe.args.bias_update_speed == 0  # the imported bias routes without any update
    copy_into_titanlab(moe, ref)
    x = torch.randn(2, 7, DIM)
    with torch.no_grad():
        want = ref(x)
        got = moe(x)
    assert got.shape == (2, 7, DIM)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_route_bias_keeps_the_bias_in_the_state_dict_and_routes_with_it():
    bias = torch.zeros(E)
    bias[:4] = 1.0  # experts 0..3 win every token's choice when the bias routes
    x = torch.randn(1, 5, DIM)
    loads = {}
    for route_bias in (True, False):
        torch.manual_seed(0)
        moe = MoE(DIM, titanlab_args(True, 4, 2, 4, route_bias=route_bias))
        moe.init_weights(0.05)
        state = moe.state_dict()
        assert "expert_bias" in state
        moe.load_state_dict({**state, "expert_bias": bias})
        moe(x)
        loads[route_bias] = moe.tokens_per_expert.clone()
    assert loads[True].tolist() == [5.0] * 4 + [0.0] * (E - 4)
    # route_bias False with bias_update_speed 0 (today's behaviour): the bias is not used.
    unbiased = moe.router(x.reshape(-1, DIM), None)[1]
    assert torch.equal(loads[False], torch.bincount(unbiased.flatten(), minlength=E).float())
    assert not torch.equal(loads[False], loads[True])


BAD_ARGS = [
    ({"n_groups": 3}, r"^n_groups=3 must be >= 1 and divide num_experts \(16\)$"),
    ({"n_groups": 0}, r"^n_groups=0 must be >= 1 and divide num_experts \(16\)$"),
    ({"n_groups": 16, "topk_groups": 4}, r"^n_groups=16 leaves 1 expert per group"),
    ({"n_groups": 4, "topk_groups": 0}, r"^topk_groups=0 must be in 1..n_groups \(4\)$"),
    ({"n_groups": 4, "topk_groups": 5}, r"^topk_groups=5 must be in 1..n_groups \(4\)$"),
    ({"n_groups": 4, "topk_groups": 1, "top_k": 5}, r"^top_k=5 exceeds the 4 experts of"),
    ({"n_groups": 8, "topk_groups": 2, "top_k": 6}, r"^top_k=6 exceeds the 4 experts of"),
]


@pytest.mark.parametrize("change,message", BAD_ARGS)
def test_bad_group_args_are_one_line(change, message):
    args = MoEArgs(**{"num_experts": E, "top_k": 2, **change})
    with pytest.raises(ValueError, match=message) as err:
        args.validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n_groups,topk_groups", [(1, 1), (4, 1), (4, 4), (8, 2)])
def test_valid_groupings_pass(n_groups, topk_groups):
    MoEArgs(num_experts=E, top_k=2, n_groups=n_groups, topk_groups=topk_groups).validate()
