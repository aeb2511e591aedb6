"""What sequence-parallel TP holds whole on every tp rank: the inputs its plan all-gathers
(kept by the column-wise Linear layers) and the head's gathered input, found while tracing the
plain model, and the per-rank block bytes that follow."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titanlab.models.llama3 import llama3_flavors
from titanlab.planning.activation_memory import ActivationBytes, trace_activation_bytes
from titanlab.planning.tp_gathered import gathering_inputs

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=512, max_seq_len=64)
BATCH, SEQ = 2, 64
ACTIVATION = BATCH * SEQ * ARGS.dim * 4  # one (batch, seq, dim) fp32 tensor


@pytest.mark.parametrize("fused_chunk", [0, 32])
def test_a_block_keeps_its_two_gathered_inputs_and_the_head_one(fused_chunk):
    traced = trace_activation_bytes(ARGS, BATCH, SEQ, torch.float32, fused_chunk=fused_chunk)
    # the attention's and the feed-forward's normalized inputs, each kept by its projections
    assert traced.gathered_per_block == {"none": 2 * ACTIVATION, "full": 0, "op": 0}
    # the head's input (plain: kept by the output Linear; fused: its gradient, made in forward)
    assert traced.gathered_head == ACTIVATION


def test_per_rank_bytes_split_all_but_the_gathered():
    traced = ActivationBytes(per_block={"none": 1000}, head=500, gathered_per_block={"none": 200},
                             gathered_head=100)  # fmt: skip
    assert traced.block_bytes("none", 1) == 1000
    assert traced.block_bytes("none", 4) == 800 // 4 + 200
    assert traced.head_bytes(2) == 400 // 2 + 100


def test_which_styles_gather():
    assert gathering_inputs(PrepareModuleInput(input_layouts=(Shard(1), None),
                                               desired_input_layouts=(Replicate(), None))) == [0]  # fmt: skip
    assert gathering_inputs(ColwiseParallel(input_layouts=Shard(1))) == [0]
    assert gathering_inputs(ColwiseParallel()) == []  # already replicated
    assert gathering_inputs(RowwiseParallel(output_layouts=Shard(1))) == []
