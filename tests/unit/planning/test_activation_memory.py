"""Tracing on fake tensors predicts, to the byte, what a real forward keeps for backward."""

import dataclasses

import pytest
import torch

from titanlab.planning.activation_memory import LiveTensorBytes, trace_activation_bytes
from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.components.loss import cross_entropy_sum
from titanlab.models.llama3 import Transformer, llama3_flavors

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=3, vocab_size=512, max_seq_len=64)


@pytest.mark.parametrize("mode", ["none", "full", "op"])
def test_trace_equals_real_forward(mode):
    traced = trace_activation_bytes(ARGS, 2, 64, torch.float32)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    apply_ac(model, "selective" if mode == "op" else mode, "op")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64))
    counter = LiveTensorBytes()
    with counter:
        loss = cross_entropy_sum(model(tokens), tokens)
    real = counter.live() - loss.untyped_storage().nbytes()
    assert real == traced.head + 3 * traced.per_block[mode]


def test_views_of_parameters_are_not_counted():
    weight = torch.randn(64, 32, requires_grad=True)
    counter = LiveTensorBytes()
    with counter:
        transposed = weight.t()
        product = torch.ones(8, 64) @ weight  # autograd keeps the ones for weight's gradient
    assert counter.live() == product.nbytes + 8 * 64 * 4  # not weight.t(), a view of the weight
    del transposed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_keeps_the_same_bytes_whatever_its_chunk(dtype):
    """The estimator traces the fused loss as one chunk (a pass per chunk takes seconds at 8B
    shapes): what the head keeps for backward must not depend on the chunk size."""
    tokens = 2 * 64
    one = trace_activation_bytes(ARGS, 2, 64, dtype, fused_chunk=tokens)
    chunked = trace_activation_bytes(ARGS, 2, 64, dtype, fused_chunk=16)
    assert one.head == chunked.head and one.per_block == chunked.per_block
    plain = trace_activation_bytes(ARGS, 2, 64, dtype)
    # the fused head keeps its input's and weight's gradients, the plain one far more (logits)
    assert one.head != plain.head


def test_fused_head_trace_equals_real_forward():
    """One chunk traced on fake tensors = what a real chunked (16-token) fused forward keeps."""
    from titanlab.components.fused_head import fused_targets, use_fused_loss

    traced = trace_activation_bytes(ARGS, 2, 64, torch.float32, fused_chunk=2 * 64)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    use_fused_loss(model, 16)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64))
    counter = LiveTensorBytes()
    with counter, fused_targets(model, tokens):
        loss = model(tokens)
    real = counter.live() - loss.untyped_storage().nbytes()
    assert real == traced.head + 3 * traced.per_block["none"]


@pytest.mark.parametrize("modes", [(), ("full",), ("op",)])
def test_a_run_traces_only_its_ac_mode_and_gets_the_full_traces_numbers(modes):
    """The trainer's pre-flight traces "none" (the head) and its own AC mode: two traces per
    mode instead of six in all; each number equals the all-modes trace's, whichever is first."""
    from titanlab.planning import activation_memory

    # a vocabulary of its own per case: nothing is in the cache yet
    args = dataclasses.replace(ARGS, vocab_size=600 + len(modes) + len("".join(modes)))
    part = trace_activation_bytes(args, 2, 64, torch.float32, modes=modes)
    traced = [k for k in activation_memory._CACHE if k[0][0] == repr(args)]
    assert sorted(mode for _, mode, _ in traced) == sorted({"none", *modes})
    whole = trace_activation_bytes(args, 2, 64, torch.float32)
    assert set(part.per_block) == {"none", *modes} and set(whole.per_block) == {
        "none",
        "full",
        "op",
    }
    assert {m: whole.per_block[m] for m in part.per_block} == part.per_block
    assert (part.head, part.gathered_head, part.weight_grads_head) == (
        whole.head, whole.gathered_head, whole.weight_grads_head)  # fmt: skip
    assert part.weight_grads_per_block == whole.weight_grads_per_block


def test_a_run_that_keeps_no_block_unchecked_compiles_no_block_under_none(monkeypatch):
    """Selective per-op AC with compiled blocks (`compiled_none=False`, what `estimate_memory`
    passes for full and per-op AC): the "op" block is measured compiled, as with
    `compiled_none`; the block under "none", which only the head's arithmetic uses, is traced
    eagerly and never compiled."""
    from titanlab.planning import activation_memory, compiled_saved

    args = dataclasses.replace(ARGS, vocab_size=513)  # shapes of this test's own
    both = trace_activation_bytes(args, 2, 64, torch.float32, compiled_blocks=True, modes=("op",))
    eager = trace_activation_bytes(args, 2, 64, torch.float32, modes=("op",))
    compiles = []
    real = compiled_saved.saved_bytes_compiled

    def counted(*a, **k):
        compiles.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(activation_memory, "_CACHE", {})
    monkeypatch.setattr(compiled_saved, "saved_bytes_compiled", counted)
    monkeypatch.setenv("TITANLAB_TRACE_CACHE", "off")  # nothing from the disk either
    one = trace_activation_bytes(
        args, 2, 64, torch.float32, compiled_blocks=True, modes=("op",), compiled_none=False
    )
    assert len(compiles) == 1  # the "op" block only
    assert one.per_block == {"op": both.per_block["op"], "none": eager.per_block["none"]}
    assert both.per_block["none"] != eager.per_block["none"]  # compiled and eager differ
    assert one.head == both.head
