"""What a zero-bubble schedule's split backward keeps between its halves: the tracer's count of
the weight ops' output bytes equals what torch's own `stage_backward_input` keeps for
`stage_backward_weight`, and the pipeline estimate holds it from "I" to "W"."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.pipelining._backward import stage_backward_input

from titanlab.components.loss import cross_entropy_sum
from titanlab.models.llama3 import Transformer, llama3_flavors
from titanlab.planning.activation_memory import trace_activation_bytes
from titanlab.planning.pipeline_memory import peak_in_flight

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=512, max_seq_len=64)
BATCH, SEQ = 2, 64


def kept_for_weights(stage: torch.nn.Module, run) -> int:
    """Bytes of the gradients torch's input half keeps for the weight half of a middle stage
    (its input requires grad): `run(x)` is the stage's forward to its output or loss."""
    x = torch.randn(BATCH, SEQ, ARGS.dim, requires_grad=True)
    out = run(x)
    grads = None if out.dim() == 0 else [torch.ones_like(out)]
    _, groups = stage_backward_input([out], grads, [x], stage.parameters())
    storages = {}
    for group in groups:
        for grad in (g for t in group["grads"] for g in t if g is not None):
            storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(storages.values())


def test_the_trace_counts_what_torch_keeps_for_the_weight_half():
    traced = trace_activation_bytes(ARGS, BATCH, SEQ, torch.float32)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    block = model.layers["0"]
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    assert kept_for_weights(block, lambda x: block(x, cos, sin)) == traced.weight_grads_per_block
    # a Llama block, per token (fp32): wq, wo, w2 and the two norms (dim each), wk, wv, w1, w3
    hidden = model.layers["0"].feed_forward.w1.out_features
    kv = model.layers["0"].attention.wk.out_features
    assert traced.weight_grads_per_block == BATCH * SEQ * 4 * (5 * ARGS.dim + 2 * kv + 2 * hidden)

    head = torch.nn.ModuleDict({"norm": model.norm, "output": model.output})
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ))
    kept = kept_for_weights(head, lambda x: cross_entropy_sum(model.output(model.norm(x)), labels))
    assert kept == traced.weight_grads_head  # the logits' gradient and the norm's
    assert kept == BATCH * SEQ * 4 * (ARGS.vocab_size + ARGS.dim)


def test_the_estimate_holds_them_from_the_input_half_to_the_weight_half():
    actions = [("F", 1), ("F", 1), ("I", 1), ("F", 1), ("W", 1), ("I", 1), ("W", 1)]
    assert peak_in_flight(actions, lambda s: 10, 0, lambda s: 3) == (33, True)
    # the first stage's input half does nothing; its weight half runs the whole backward
    first = [("F", 0), ("F", 0), ("I", 0), ("F", 0), ("W", 0)]
    assert peak_in_flight(first, lambda s: 10, 0, lambda s: 3) == (30, True)
