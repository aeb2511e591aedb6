"""Every activation-checkpointing mode gives the no-AC gradients; full and per-layer AC keep
fewer activations for backward."""

import copy

import pytest
import torch

from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.loss import cross_entropy_sum
from titanlab.models.llama3 import Transformer, TransformerModelArgs

ARGS = TransformerModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128,
                            multiple_of=32, max_seq_len=32)


def make_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def saved_bytes_and_grads(model):
    """Bytes of tensors autograd keeps for backward during forward, and the gradients."""
    inputs, labels = batch()
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


def clean(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "")


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_ac_gradients_equal_and_memory_lower(mode, option):
    base_bytes, base_grads = saved_bytes_and_grads(make_model())
    model = make_model()
    apply_ac(model, mode, option)
    ac_bytes, grads = saved_bytes_and_grads(model)
    grads = {clean(n): g for n, g in grads.items()}
    assert grads.keys() == base_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, base_grads[name], atol=1e-6, rtol=0), name
    if option != "op":
        # The outer hooks see what autograd keeps outside checkpointed regions. Op-level SAC keeps
        # its saved outputs in its own cache, invisible to them, so it is not measured here.
        assert ac_bytes < 0.8 * base_bytes, (mode, option, ac_bytes, base_bytes)


def test_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match=r"^activation_checkpoint.mode='half'; valid: none, full, selective$"):
        apply_ac(make_model(), "half")
