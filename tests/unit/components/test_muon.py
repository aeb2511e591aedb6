"""Muon + AdamW in one optimizer against torch.optim.Muon + torch.optim.AdamW."""

import copy
import dataclasses
import re

import pytest
import torch

from titanlab.components.muon import MuonAdamW, orthogonalized, param_groups, takes_muon
from titanlab.components.optim import build_optimizer
from titanlab.config.job_config import ConfigError, JobConfig, Optimizer
from titanlab.models.registry import build_model, get_family

CFG = Optimizer(name="Muon", lr=0.02, weight_decay=0.1, implementation="for-loop")


def model_of(family: str, flavor: str, seed: int = 0) -> torch.nn.Module:
    args = dataclasses.replace(get_family(family).flavors[flavor], vocab_size=96, max_seq_len=16)
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model


def random_grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_blocks_matrices_take_muon_and_the_rest_adamw():
    model = model_of("deepseek_v3", "debugmodel")
    muon = {n for n, p in model.named_parameters() if takes_muon(n, p)}
    assert "layers.0.attention.wq_a.weight" in muon
    assert "layers.1.feed_forward.experts.w1" in muon  # an expert stack: a matrix per expert
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight",
                 "layers.0.attention_norm.weight", "layers.1.feed_forward.router.gate.weight",
                 "mtp.0.eh_proj.weight"):  # fmt: skip
        assert name not in muon


def test_one_process_equals_torch_muon_plus_adamw_within_1e_6():
    ours = model_of("llama3", "debugmodel_deep")
    ref = copy.deepcopy(ours)
    opt = build_optimizer(ours, CFG, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    matrices = [p for n, p in ref.named_parameters() if takes_muon(n, p)]
    rest = [p for n, p in ref.named_parameters() if not takes_muon(n, p)]
    ref_opts = [
        torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                         adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          foreach=False),
    ]  # fmt: skip
    for step in range(3):
        random_grads(ours, step)
        random_grads(ref, step)
        opt.step()
        for o in ref_opts:
            o.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # one momentum buffer per matrix, AdamW's two moments for the rest
    state = opt.state[ours.layers["0"].attention.wq.weight]
    assert set(state) == {"momentum_buffer", "step"} and state["step"].item() == 3
    assert set(opt.state[ours.norm.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_an_expert_stack_is_updated_as_one_matrix_per_expert():
    stack = torch.nn.Parameter(torch.randn(3, 8, 5))
    alone = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    opt = MuonAdamW([{"params": [stack], "muon": True}], CFG)
    ref = torch.optim.Muon(alone, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        grad = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(step))
        stack.grad = grad.clone()
        for e in range(3):
            alone[e].grad = grad[e].clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in alone]),
                               rtol=0, atol=1e-6)  # fmt: skip
    assert orthogonalized(torch.randn(2, 4, 6), 5).shape == (2, 4, 6)


def test_muon_options_go_to_the_muon_group_only():
    model = model_of("llama3", "debugmodel_deep")
    cfg = dataclasses.replace(CFG, muon_lr=0.05, muon_weight_decay=0.0)
    groups = param_groups(model, cfg)
    assert [g["muon"] for g in groups] == [True, False]
    assert groups[0]["lr"] == 0.05 and groups[0]["weight_decay"] == 0.0
    opt = MuonAdamW(groups, cfg)
    assert opt.param_groups[1]["lr"] == 0.02 and opt.param_groups[1]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("muon_momentum", 1.0, "optimizer.muon_momentum=1.0 must be in [0, 1)"),
        ("muon_ns_steps", 0, "optimizer.muon_ns_steps=0 must be in 1..99"),
        ("muon_lr", 0.0, "optimizer.muon_lr=0.0 must be > 0"),
        ("muon_weight_decay", -0.5, "optimizer.muon_weight_decay=-0.5 must be >= 0"),
    ],
)
def test_bad_muon_options_are_one_line(field, value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        dataclasses.replace(CFG, **{field: value}).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [("muon_lr", 0.02), ("muon_momentum", 0.9), ("muon_ns_steps", 3), ("muon_ns_dtype", "float32")],
)
def test_a_muon_option_without_muon_is_one_line(field, value):
    cfg = dataclasses.replace(Optimizer(), **{field: value})  # optimizer.name AdamW
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert f"optimizer.{field}={value}" in str(e.value) and "optimizer.name=AdamW" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("section", "field", "value", "says"),
    [
        ("peft", "method", "lora", "peft.method=lora"),
        ("float8", "enable", True, "float8.enable=true"),
        ("rl", "algorithm", "grpo", "rl.algorithm"),
    ],
)
def test_what_muon_does_not_take_yet_is_one_line_before_launch(section, field, value, says):
    from titanlab.components.muon import check_muon

    config = JobConfig()
    config.optimizer.name = "Muon"
    setattr(getattr(config, section), field, value)
    with pytest.raises(ConfigError, match=f"optimizer.name=Muon with {says}"):
        check_muon(config)


def test_float32_newton_schulz_is_torchs_iteration_without_bfloat16_rounding():
    """The same iteration as torch's bfloat16 one: equal in float64 arithmetic to the float32
    one, and near the bfloat16 one (its rounding, ~1e-2)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from titanlab.components.muon import NS_COEFFICIENTS, newton_schulz_fp32

    g = torch.randn(12, 7, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz_fp32(g, 5)
    bf16 = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7).float()
    torch.testing.assert_close(ours, bf16, rtol=0, atol=5e-2)
    x = g.double().T / g.double().norm()
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(ours.double(), x.T, rtol=0, atol=1e-5)
    # singular values pushed towards 1 (the orthogonalization), from the scaled gradient's
    s = torch.linalg.svdvals(ours)
    assert s.min() > 0.5 and s.max() < 1.3


def test_an_unknown_optimizer_name_is_one_line_with_did_you_mean():
    from titanlab.config.manager import build_config

    with pytest.raises(ConfigError) as e:
        build_config(["--optimizer.name", "muon"])
    assert str(e.value) == (
        "optimizer.name='muon' is not valid; valid: AdamW, Muon; did you mean 'Muon'?"
    )
