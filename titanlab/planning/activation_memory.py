"""Activation memory: the bytes a forward pass leaves alive for backward, found by tracing.

Formulas such as "34·s·b·h bytes per layer" (Korthikanti et al. 2022) assume a GPT block with a
4h MLP, full multi-head attention and dropout; a Llama block (SwiGLU, GQA, RoPE, no dropout) and
each activation-checkpointing mode keep different tensors. So the estimate runs the real model
code once on fake tensors (`FakeTensorMode`: shapes and dtypes only, no memory, no compute) and
counts the storages still alive after forward, which are exactly what autograd, or the
selective-AC cache, holds for backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import types
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


AC_MODES = ("none", "full", "op")
"""The activation-checkpointing modes a block is traced under: none, full, and selective per op."""


class LiveTensorBytes(TorchDispatchMode):
    """Records the storage of every tensor an op creates under this mode (views of an input,
    such as a transposed weight, create none); `live()` sums the bytes of those still alive.
    Works on real and on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            StorageWeakRef(t.untyped_storage()).cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in inputs:
                    self._storages[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def live(self) -> int:
        """Bytes of the recorded storages still referenced by anything (young reference cycles
        are collected first; a full collection would cost ~0.2 s per call)."""
        gc.collect(0)
        return sum(n for ref, n in self._storages.values() if not ref.expired())


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Bytes kept for backward, per rank: `per_block[mode]` for one transformer block under AC
    mode "none", "full" or "op", `head` for everything outside the blocks (embedding, final
    norm, output projection and the loss, which keeps the fp32 log-softmax of the logits), and
    `depths[mode]` for multi-token prediction depths."""

    per_block: dict[str, int]
    head: int
    depths: dict[str, int] = dataclasses.field(default_factory=dict)
    """Trained multi-token prediction depths (DeepSeek-V3), all together, by the AC mode of
    their blocks: their blocks, norms and eh_proj, and their loss's fp32 log-softmax; empty
    without trained depths."""
    gathered_per_block: dict[str, int] = dataclasses.field(default_factory=dict)
    """Of `per_block[mode]`, the bytes tensor parallel holds whole on every tp rank: the inputs
    its plan all-gathers over the sequence (the attention's and the feed-forward's, kept by
    their column-wise Linears; `titanlab.distributed.tensor_parallel.plan`), where the rest is
    split."""
    gathered_head: int = 0
    """Of `head`, the bytes held whole on every tp rank: the output projection's gathered input
    (or, for the fused loss's head, the gradient of that input, computed in forward)."""
    weight_grads_per_block: int = 0
    """What a split backward keeps per block between its input and weight halves: a gradient
    the size of each weight op's output (`titanlab.planning.split_backward`)."""
    weight_grads_head: int = 0
    """The same for the head (final norm, output projection; the plain head's logits)."""

    def split(self, total: int, gathered: int, tp: int) -> int:
        """Bytes per tp rank of `total` bytes of which `gathered` are held whole by each."""
        gathered = min(gathered, total) if tp > 1 else 0
        return (total - gathered) // tp + gathered

    def block_bytes(self, mode: str, tp: int) -> int:
        """Bytes one block keeps per tp rank in AC mode `mode` (sequence-parallel TP)."""
        return self.split(self.per_block[mode], self.gathered_per_block.get(mode, 0), tp)

    def head_bytes(self, tp: int) -> int:
        """Bytes the head keeps per tp rank (its logits vocab-split under loss parallel)."""
        return self.split(self.head, self.gathered_head, tp)


@dataclasses.dataclass(frozen=True)
class _ModeTrace:
    """One AC mode's traces: (live, gathered, weight-op output) bytes after the forward of the
    1-unit and 2-unit models, the compiled block's saved bytes (None: eager or not captured),
    and what trained multi-token prediction depths add (None: none trained)."""

    one: tuple[int, int, int]
    two: tuple[int, int, int]
    compiled: int | None
    depth: int | None


_CACHE: dict[tuple, _ModeTrace] = {}
"""Traces by (arguments, AC mode, whether the block was compiled): a process that plans many
layouts of one model traces each mode once."""
_HEAD_CACHE: dict[tuple, int] = {}
"""A compiled loss's head bytes (the eager head up to the logits, then the loss) by arguments."""


def _experts_static_shapes(self, x_td: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Stand-in for `GroupedExperts.forward` while tracing: the same (tokens·k, hidden)
    activations as the per-expert loop, through expert 0's weights, without splitting by the
    (data-dependent) counts; gpt-oss's biased clamped-SwiGLU experts likewise."""
    if hasattr(self, "gate_up_proj"):  # `ClampedSwiGLUExperts`
        h = self.activation(x_td @ self.gate_up_proj[0] + self.gate_up_proj_bias[0])
        return h @ self.down_proj[0] + self.down_proj_bias[0]
    h = torch.nn.functional.silu(x_td @ self.w1[0].t()) * (x_td @ self.w3[0].t())
    return h @ self.w2[0].t()


def unit_blocks(model_args) -> int:
    """Blocks in the repeating unit of the model: the shortest period of its blocks' kinds
    (`token_mixer.block_kinds`: attention window, linear or full attention) that repeats at
    least twice; gpt-oss alternates sliding and full (2), Qwen3.5 has three linear layers per
    full one (4). 1 when every block is alike or no period repeats twice."""
    from titanlab.models.common.token_mixer import block_kinds

    kinds = block_kinds(model_args)
    n = len(kinds)
    for period in range(1, n // 2 + 1):
        if all(kinds[i] == kinds[i % period] for i in range(n)):
            return period
    return 1


def trace_activation_bytes(
    model_args,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    autocast: bool = False,
    compiled_blocks: bool = False,
    compiled_loss: bool = False,
    float8: Any = None,
    fused_chunk: int = 0,
    modes: tuple[str, ...] = AC_MODES,
    compiled_none: bool = True,
) -> ActivationBytes:
    """Trace forward + loss of 1- and 2-block versions of the model on fake tensors.

    Args:
        model_args: a registered family's args (vocab_size set).
        batch, seq: local batch size and sequence length (tokens per sample) of one rank.
        dtype: compute dtype of activations (fp32, or bf16/fp16 under mixed precision).
        autocast: fp32 weights and `torch.autocast` to `dtype` (mixed precision without FSDP):
            the compute-dtype copies of the weights that autocast keeps for backward count too.
        compiled_blocks / compiled_loss: the blocks / the loss run under torch.compile; their
            saved bytes are read from the compiled forward graph (`titanlab.planning.compiled_saved`).
        float8: the run's `Float8` config when float8 training is on (its Linear layers then
            keep float8 copies of their inputs and weights), traced in torchao's emulate mode.
        fused_chunk: the fused linear cross-entropy's chunk size (0: the plain head and loss);
            its head keeps no logits, but the gradients of its input and weight, computed in
            forward.
        modes: the AC modes to trace (of `AC_MODES`; "none" always is, for the head): a run
            needs its own, the layout planner all. Each costs two traces (three with trained
            multi-token prediction depths, a compile more with compiled blocks).
        compiled_none: with compiled blocks, whether the block under no AC is measured compiled
            too. A run whose blocks all checkpoint (full AC) or all save per op (selective per
            op) keeps no block under "none", which is traced only for the head: False skips
            that compile (at Qwen3.5 27B's seq 4096 a third of the pre-flight, ~20 s on a 2-core
            CPU), and `per_block["none"]` is then the eager trace's.
    Returns:
        bytes per block for each traced AC mode and for the head; each mode's traces are
        cached per arguments (a trace takes about a second for the 8B shapes, whatever seq is;
        a compiled one a few seconds), in this process and on disk for the other processes of
        this machine (`titanlab.planning.trace_cache`: a rank reads what the launcher's
        pre-flight or another rank traced).
    """
    from titanlab.planning.compiled_saved import saved_bytes_compiled
    from titanlab.planning.split_backward import WeightOpOutputs
    from titanlab.planning.trace_cache import remembered
    from titanlab.planning.tp_gathered import watch_gathered
    from titanlab.distributed.activation_checkpoint import apply_ac
    from titanlab.components.fused_head import fused_targets, use_fused_loss
    from titanlab.components.loss import cross_entropy_sum
    from titanlab.models.common.decoder import moe_layers
    from titanlab.models.common.mtp import mtp_targets, trains_mtp
    from titanlab.models.common.shortened import shortened
    from titanlab.models.registry import build_model

    weight_dtype = torch.float32 if autocast else dtype

    def build(n_layers: int, mode: str):
        args = dataclasses.replace(shortened(model_args, n_layers), max_seq_len=max(seq, 1))
        with torch.device("meta"):
            model = build_model(args).to(weight_dtype)
        for moe in moe_layers(model):  # fake tensors cannot split by data-dependent counts
            moe.experts.forward = types.MethodType(_experts_static_shapes, moe.experts)  # type: ignore[method-assign]
        if float8 is not None:
            from titanlab.precision.float8 import apply_float8

            emulated = dataclasses.replace(
                float8, emulate=True, enable_fsdp_float8_all_gather=False
            )
            apply_float8(model, emulated, torch.device("cpu"), fsdp_enabled=False)
        apply_ac(model, "selective" if mode == "op" else mode, "op")
        if fused_chunk:
            use_fused_loss(model, fused_chunk)
        return model

    def precision():
        return torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()

    def live_after_forward(
        n_layers: int, mode: str, with_loss: bool = True, with_depths: bool = False
    ) -> tuple[int, int, int]:
        """(bytes alive after forward, of them those tensor parallel would gather, the output
        bytes of the weight ops: what a split backward keeps between its halves)."""
        model = build(n_layers, mode)
        # Fake CPU tensors rather than meta ones: SDPA then picks the fused (flash) kernel, which
        # keeps O(seq) per head as on GPUs, where meta would pick the O(seq²) math kernel.
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            tokens = torch.zeros(batch, seq, dtype=torch.long)
            counter = LiveTensorBytes()
            gathered = watch_gathered(model, lambda: counter._storages)
            weight_ops = WeightOpOutputs(model.parameters())
            # trained multi-token prediction depths run in the training forward (the head's)
            depths = mtp_targets(model, tokens, 0.0) if with_depths else None
            with counter, weight_ops, precision(), depths or contextlib.nullcontext():
                if fused_chunk and with_loss:
                    with fused_targets(model, tokens):
                        out = model(tokens)
                else:
                    out = model(tokens)
                if with_loss and not fused_chunk:
                    out = cross_entropy_sum(out, tokens)
            held = counter.live() - (out.untyped_storage().nbytes() if with_loss else 0)
            whole = gathered.live()
            del out
        return held, whole, weight_ops.bytes

    def compiled_block(mode: str) -> int:
        model = build(1, mode)
        block = cast(nn.ModuleDict, model.layers)["0"]
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            x_dtype = torch.float32 if autocast else dtype  # autocast: an fp32 residual stream
            x = torch.zeros(batch, seq, model_args.dim, dtype=x_dtype, requires_grad=True)
            cos, sin = model.rope_cos, model.rope_sin
            with precision():
                return saved_bytes_compiled(block, x, cos, sin)

    def compiled_loss_bytes() -> int:
        with FakeTensorMode(allow_non_fake_inputs=True):
            logits = torch.zeros(batch, seq, model_args.vocab_size, dtype=dtype, requires_grad=True)
            labels = torch.zeros(batch, seq, dtype=torch.long)
            return saved_bytes_compiled(cross_entropy_sum, logits, labels)

    key = (
        repr(model_args),
        batch,
        seq,
        dtype,
        autocast,
        compiled_blocks,
        compiled_loss,
        repr(float8),
        fused_chunk,
    )
    # Blocks that alternate kinds (gpt-oss: sliding, full, ...) are measured a pair at a time:
    # per block, the mean of the pair; the head, what u blocks leave besides theirs.
    u = unit_blocks(model_args)

    def compiles(mode: str) -> bool:
        return compiled_blocks and (compiled_none or mode != "none")

    def measure(mode: str) -> _ModeTrace:
        one, two = live_after_forward(u, mode), live_after_forward(2 * u, mode)
        compiled = None
        if compiles(mode):
            try:
                compiled = compiled_block(mode)
            except Exception:  # a block compile cannot capture whole: estimated as eager code
                compiled = None
        depth = None
        if trains_mtp(model_args):  # the same one-block model, its depths trained
            depth = live_after_forward(1, mode, with_depths=True)[0] - one[0]
        return _ModeTrace(one, two, compiled, depth)

    def remembered_measure(mode: str) -> _ModeTrace:  # on disk, for the other processes
        name = f"{key!r} mode={mode}" + ("" if compiles(mode) == compiled_blocks else " eager")
        saved = remembered(name, lambda: dataclasses.asdict(measure(mode)))
        return _ModeTrace(tuple(saved["one"]), tuple(saved["two"]), saved["compiled"],
                          saved["depth"])  # fmt: skip

    traces = {}
    for mode in dict.fromkeys(("none", *modes)):  # "none" gives the head; each mode is kept
        cached = (key, mode, compiles(mode))
        if (key, mode, True) in _CACHE:  # its eager traces serve an uncompiled block too
            cached = (key, mode, True)
        if cached not in _CACHE:
            _CACHE[cached] = remembered_measure(mode)
        traces[mode] = _CACHE[cached]
    none = traces["none"]
    eager = {mode: (t.two[0] - t.one[0]) // u for mode, t in traces.items()}
    gathered = {mode: (t.two[1] - t.one[1]) // u for mode, t in traces.items()}
    head = none.one[0] - u * eager["none"]
    gathered_head = none.one[1] - u * gathered["none"]
    weight_grads = (none.two[2] - none.one[2]) // u
    if compiled_loss and not fused_chunk:  # the head up to the logits, run eagerly, then the
        # compiled loss
        if key not in _HEAD_CACHE:
            _HEAD_CACHE[key] = remembered(
                f"{key!r} compiled head",
                lambda: live_after_forward(u, "none", with_loss=False)[0] + compiled_loss_bytes(),
            )
        head = _HEAD_CACHE[key] - u * eager["none"]
    per_block = eager
    compiled = [mode for mode in traces if compiles(mode)]
    if compiled and all(traces[mode].compiled is not None for mode in compiled):
        per_block = {
            mode: cast(int, t.compiled) if mode in compiled else eager[mode]
            for mode, t in traces.items()
        }
    depths = {}
    if trains_mtp(model_args):
        depths = {mode: cast(int, t.depth) for mode, t in traces.items()}
    return ActivationBytes(
        per_block=per_block,
        head=head,
        depths=depths,
        gathered_per_block=gathered,
        gathered_head=gathered_head,
        weight_grads_per_block=weight_grads,
        weight_grads_head=none.one[2] - u * weight_grads,
    )


def traced_modes(mode: str, option: str) -> tuple[str, ...]:
    """The traced block modes (`trace_activation_bytes`) that activation checkpointing `mode`
    with `option` keeps for backward besides "none": full AC and every-Nth-block selective AC
    "full" (their checkpointed blocks), per-op selective AC "op", no AC nothing more."""
    if mode == "full" or (mode == "selective" and option != "op"):
        return ("full",)
    return ("op",) if mode == "selective" else ()


def depth_bytes(depths: dict[str, int], mode: str, option: str, n_layers: int) -> int:
    """What trained multi-token prediction depths keep for backward in the AC mode (their
    blocks are wrapped like the layers, numbered after them: `apply_ac`); 0 without depths."""
    if not depths:
        return 0
    if mode == "full":
        return depths["full"]
    if mode == "selective" and option == "op":
        return depths["op"]
    if mode == "selective":
        return depths["full" if n_layers % int(option) == 0 else "none"]
    return depths["none"]
