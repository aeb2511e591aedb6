"""The code as the recorded GPU rows ran it, replayed for `tools/ledger_calibration.py`: the
fused loss of 2026-11-27 (`before_2026_11_28`), RoPE in real pairs (`real_pair_rope`), SDPA's
cuDNN backend switched (`cudnn_sdp`), and QLoRA's NF4 base on the CPU where the ledger's fake
step needs it (`nf4_base`, `nf4_on_cpu`: `titanlab ledger` cannot price QLoRA yet,
docs/ledger.md "Limits"). Each context manager restores what it changed."""

from __future__ import annotations

import contextlib

import torch


class PerChunkFp32Sums:
    """The fused loss's weight gradient as it ran until 2026-11-28 (`RowGradients`' interface):
    each chunk's rows of G in the hidden states' dtype (fp32 under autocast), added to a
    zero-initialized fp32 sum at once with an fp32 GEMM (`addmm_`)."""

    def __init__(self, xs, vocab, chunk_size, dtype) -> None:
        self.xs, self.vocab, self.g = xs, vocab, None
        self.sums = [x.new_zeros((vocab, x.shape[1]), dtype=torch.float32) for x in xs]

    def next_rows(self, c: int):
        self.g = self.xs[0].new_empty(c, self.vocab)
        return self.g

    def keep(self, g):
        self.g = g.to(self.xs[0].dtype)
        return self.g

    def flush(self, end: int) -> None:
        rows = self.g.shape[0]
        for total, x in zip(self.sums, self.xs):
            total.addmm_(self.g.t().float(), x[end - rows : end].float())

    def results(self):
        return self.sums


@contextlib.contextmanager
def before_2026_11_28(on: bool):
    """The fused loss as the H200 rows of 2026-11-27 ran it: autocast casting the head's fp32
    weight in every chunk's GEMMs, and the weight gradient summed chunk by chunk as fp32
    GEMMs."""
    import titanlab.components.fused_ce as fused_ce

    before = fused_ce._operands, fused_ce.RowGradients
    if on:
        fused_ce._operands = lambda h, w: ((h[:1] @ w[:1].t()).dtype, h, w)
        fused_ce.RowGradients = PerChunkFp32Sums
    try:
        yield
    finally:
        fused_ce._operands, fused_ce.RowGradients = before


@contextlib.contextmanager
def real_pair_rope():
    """RoPE as every recorded row ran it: in real pairs (ten eager kernels a tensor), not the
    complex product eager runs have taken since 2026-11-30."""
    import titanlab.models.common.rope as rope

    before = rope._as_complex
    rope._as_complex = lambda x: False
    try:
        yield
    finally:
        rope._as_complex = before


@contextlib.contextmanager
def cudnn_sdp(on: bool):
    """SDPA's cuDNN backend enabled or not (`torch.backends.cuda.enable_cudnn_sdp`, as
    `tools/gpu_bench_row.py`'s FA2 row sets it), restored after: the ledger's SDPA takes the
    kernel CUDA would among the enabled backends (`titanlab.ledger.gpu_kernels.sdpa_kernel`)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(on)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def nf4_base(folder: str, hidden: int, layers: int) -> str:
    """A DCP checkpoint in `folder` holding a Llama's adapted base weights (wq and wv, each
    (hidden × hidden), of its `layers` blocks, fp32 as `convert_checkpoint from-hf` stores them), which QLoRA's
    `quantize_base` needs at `checkpoint.initial_load_path`: their values do not change the
    ledger (one value, 0.02, everywhere). Returns `folder`."""
    import warnings

    import torch.distributed.checkpoint as dcp

    weights = {f"model.layers.{i}.attention.{w}.weight": torch.full((hidden, hidden), 0.02)
               for i in range(layers) for w in ("wq", "wv")}  # fmt: skip
    with warnings.catch_warnings():  # no process group: DCP saves as one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(weights, checkpoint_id=folder)
    return folder


@contextlib.contextmanager
def nf4_on_cpu(on: bool):
    """QLoRA's NF4 base quantized on the CPU from `nf4_base`'s weights, where a dry run leaves
    it on the meta device (`quantize_base` reads only the checkpoint's shapes there): the
    ledger's fake tensors live on the CPU and cannot mix with meta ones. The NF4 weights are
    then real CPU tensors the recorded step dequantizes as on the GPU (torchao's `linear_nf4`:
    the weight dequantized to the input's dtype, then one GEMM)."""
    import titanlab.trainer.peft_steps as peft_steps

    before = peft_steps.quantize_base

    def on_cpu(part, path, **kwargs):
        return before(part, path, **{**kwargs, "device": "cpu"})

    if on:
        peft_steps.quantize_base = on_cpu
    try:
        yield
    finally:
        peft_steps.quantize_base = before
