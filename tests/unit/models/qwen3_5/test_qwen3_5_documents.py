"""Packed documents through the whole Qwen3.5 model (the trainer's document mask: ids and RoPE
positions restarting per document): each document's logits equal the model's on that document
alone, the linear-attention layers restarting their convolution and recurrence at its first
token and the full-attention layers masking the others (fp64, 1e-9)."""

import dataclasses

import torch

from titanlab.models.qwen3_5 import Qwen35Transformer, qwen3_5_flavors


def test_each_packed_document_is_computed_as_if_alone():
    args = dataclasses.replace(qwen3_5_flavors["debugmodel"], vocab_size=97, max_seq_len=160,
                               full_attention_interval=2)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen35Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-centered norms start at the identity: move them
                p.normal_(0.0, 0.2)
    lengths = [[70, 30, 60], [160]]
    tokens = torch.randint(0, 97, (2, 160), generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[j for n in row for j in range(n)] for row in lengths])
    with torch.no_grad():
        packed = model(tokens, segments=segments, positions=positions)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(tokens[b : b + 1, start : start + n])[0]
                worst = (packed[b, start : start + n] - alone).abs().max().item()
                assert worst <= 1e-9, (b, start, worst)
                start += n
