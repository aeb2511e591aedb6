"""The output head's weight gradient in the fused loss: Gᵀ X summed over the chunks of tokens
into an fp32 (V, D) gradient, where G (tokens, V) is the logits' gradient, computed a chunk at
a time, and X (tokens, D) the head's inputs.

Adding one chunk's product at a time (Liger's FusedLinearCrossEntropy, Wijmans et al. 2024)
reads and writes the whole fp32 sum once per chunk: for Llama 3's 128,256 × 4,096 head, 5.2 GB
of traffic per chunk, 64 ms per 8,192 tokens on an H100 at 256-token chunks, which made the
fused-loss step 1.7× the plain loop's in the per-op ledger (docs/ledger.md). `RowGradients`
keeps G's rows of a group of chunks instead, in the compute dtype, and adds the group's product
with one GEMM: a group holds as many rows as fit in the bytes of the fp32 sum (2·D rows in
bf16), so the buffer costs at most what the sum does, and a sequence of up to 2·D tokens
(8,192 for an 8B model) takes a single GEMM, as the plain loss's backward does.
"""

from __future__ import annotations

import torch

from titanlab.config.device_path import device_type


def product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b for the weight gradient: in fp32 on CPU, in `dtype` (the logits' GEMM's: bf16
    under autocast or FSDP's param dtype) on an accelerator, where an fp32 GEMM runs at a small
    fraction of the bf16 rate. Measured on one H200 (Llama 3 8B blocks, vocab 128,256, 8,192
    tokens): the head's weight gradient as fp32 GEMMs made titanlab's compiled bf16 step 0.548 s
    against torchtitan's 0.328 s. Under autocast (one GPU, fp32 weights) the operands are fp32
    while the logits' GEMM ran in bf16: `dtype` keeps the product in bf16 there too."""
    if device_type(a) == "cpu" or dtype == torch.float32:
        return a.float() @ b.float()
    return a.to(dtype) @ b.to(dtype)


def group_rows(dim: int, chunk_size: int, dtype: torch.dtype, tokens: int) -> int:
    """Rows of G a group holds: as many whole chunks as fit in the bytes of an fp32 (V, dim)
    sum (dim · 4 / itemsize rows), at least one chunk, at most `tokens`."""
    fit = dim * 4 // dtype.itemsize // chunk_size * chunk_size
    return min(max(chunk_size, fit), tokens)


class RowGradients:
    """Gᵀ X for each X of `xs` ((tokens, ·), the same tokens as G's rows), G given a chunk at a
    time: `next_rows(c)` is where a chunk's c rows of G go (in `dtype`; `keep(g)` copies them
    there); after each chunk, `flush(end)` (end: the tokens done so far) multiplies a full
    group, or the last, partial one when `end` is the total. `results()`: one product per X,
    in the product's dtype when one group held every token (as the plain head's backward GEMM
    gives it), else summed in fp32."""

    def __init__(
        self, xs: list[torch.Tensor], vocab: int, chunk_size: int, dtype: torch.dtype
    ) -> None:
        self.xs, self.dtype, self.tokens, self.vocab = xs, dtype, xs[0].shape[0], vocab
        self.rows = group_rows(xs[0].shape[1], chunk_size, dtype, self.tokens)
        self.buffer = xs[0].new_empty(self.rows, vocab, dtype=dtype)
        self.filled = 0
        self.sums: list[torch.Tensor | None] = [None] * len(xs)

    def next_rows(self, c: int) -> torch.Tensor:
        """The group's next c rows, (c, V) in `dtype`, for the caller to write G into."""
        rows = self.buffer[self.filled : self.filled + c]
        self.filled += c
        return rows

    def keep(self, g: torch.Tensor) -> torch.Tensor:
        """Store `g` ((c, V), any float dtype) as the group's next rows; returns them."""
        rows = self.next_rows(g.shape[0])
        rows.copy_(g)
        return rows

    def flush(self, end: int) -> None:
        """Multiply the group if it is full, or if `end` is the last token."""
        if self.filled < self.rows and end < self.tokens:
            return
        g = self.buffer[: self.filled].t()
        for i, x in enumerate(self.xs):
            p = product(g, x[end - self.filled : end], self.dtype)
            total = self.sums[i]
            if total is None:
                self.sums[i] = p
            else:  # a second group: the sum in fp32 from here on
                total = total.float() if total.dtype != torch.float32 else total
                self.sums[i] = total.add_(p)
        self.filled = 0

    def results(self) -> list[torch.Tensor]:
        """Gᵀ X per X, (V, ·); zeros (fp32) where there were no tokens."""
        return [
            s if s is not None else x.new_zeros((self.vocab, x.shape[1]), dtype=torch.float32)
            for s, x in zip(self.sums, self.xs)
        ]
