"""PPO's pieces: GAE against a hand-computed case, the clipped value loss, per-token
advantages in the surrogate, and the value head read from the trunk."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.value_head import add_value_head, read_values, zero_value_head


def test_gae_against_a_hand_computed_case():
    # one completion of 3 counted tokens (then 1 padding), reward 1 on the last, γ = 1, λ = 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 0.1, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, returns = obj.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # δ2 = 1 − 0.1 = 0.9; δ1 = 0.1 − 0.2 = −0.1; δ0 = 0.2 − 0.5 = −0.3
    # Â2 = 0.9; Â1 = −0.1 + 0.5·0.9 = 0.35; Â0 = −0.3 + 0.5·0.35 = −0.125
    assert adv[0].tolist() == pytest.approx([-0.125, 0.35, 0.9, 0.0])
    assert returns[0].tolist() == pytest.approx([0.375, 0.55, 1.0, 0.0])
    # γ < 1 discounts the next value: δ1 = 0.9·0.1 − 0.2
    adv, _ = obj.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert adv[0, 1].item() == pytest.approx(0.9 * 0.1 - 0.2 + 0.9 * (1 - 0.1))


def test_value_loss_is_clipped_around_the_rollouts_value():
    old, ret = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    v = torch.tensor([0.5, 2.0], requires_grad=True)
    loss = obj.value_loss(v, old, ret, clip=0.2)
    # first: max((0.5−1)², (0.2−1)²)/2 = 0.32 (the clipped term binds, no gradient)
    # second: max((2−1)², (0.2−1)²)/2 = 0.5 (unclipped binds)
    assert loss.tolist() == pytest.approx([0.32, 0.5])
    loss.sum().backward()
    assert v.grad is not None and v.grad.tolist() == pytest.approx([0.0, 1.0])


def test_per_token_advantages_in_the_surrogate():
    logp = torch.zeros(1, 2, requires_grad=True)
    per_token, _ = obj.clipped_surrogate(
        logp, torch.zeros(1, 2), torch.tensor([[1.0, -2.0]]), 0.2, 0.2
    )
    per_token.sum().backward()
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([-1.0, 2.0])


def test_the_value_head_reads_the_final_norm_and_starts_at_zero():
    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel"), dim=64, n_layers=2,
                               n_heads=4, n_kv_heads=2, vocab_size=16, max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    add_value_head(model)
    zero_value_head([model])
    x = torch.randint(0, 16, (2, 7))
    with read_values(model) as values:
        logits = model(x)
    assert values[0].shape == (2, 7) and values[0].abs().max().item() == 0.0
    torch.nn.init.normal_(model.value_head.weight)
    with read_values(model) as values:
        assert torch.equal(model(x), logits)  # the forward's output is unchanged
    h = model.norm(model.layers["1"](model.layers["0"](model.tok_embeddings(x), model.rope_cos,
                                                        model.rope_sin), model.rope_cos, model.rope_sin))  # fmt: skip
    assert torch.allclose(values[0], h @ model.value_head.weight, atol=1e-5)
    model.norm = None
    with pytest.raises(ValueError, match="needs the model's final norm"):
        add_value_head(model)
