"""Activation checkpointing (AC) of transformer blocks: full, selective per layer, selective per op.

- full: every block's activations are recomputed in backward (Chen et al. 2016, "Training Deep
  Nets with Sublinear Memory Cost").
- selective per layer (`selective_ac_option = N`): every N-th block is fully checkpointed.
- selective per op (`selective_ac_option = "op"`): inside each block, the outputs of attention
  kernels, of reduce-scatters and expert parallel's all-to-alls, and of every other matmul
  (the experts' grouped GEMMs among them) are saved; everything else (norms, activations,
  elementwise ops) is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models"; the save list follows torchtitan's recipe, with the MoE layer's
  grouped GEMMs and all-to-alls added: left out, an MoE block's recomputation ran every expert
  GEMM and all-to-all of its forward again, as full AC does).

The same policy holds compiled: a block compiled around its checkpoint (`torch.compile` traces
the checkpoint with its `context_fn`) has the policy's choices applied by AOTAutograd's
partitioner (`tests/unit/distributed/test_moe_compile.py` counts them in the backward graph).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import cast

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Ops whose outputs are always kept under op-level selective AC: attention kernels (expensive to
# recompute), reduce-scatter and all-to-all outputs (recomputing them means communicating
# again) and the max used by float8 scaling.
_SAVE_ALWAYS = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    _aten.max.default,
}
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default}


def _ignore_profiler_ops_in_sac() -> None:
    """Keep the profiler's `record_function` ops out of SAC's replay count.

    SAC replays the forward's ops by (op, invocation index). FSDP2's hooks open a
    `record_function` range on every pre-forward, and a module sharded on its own inside a
    checkpointed block (the experts under expert parallel) runs them a different number of
    times in the recompute than in the forward, so the recompute failed with "invocation index
    N ... not found in storage" (pytorch/torchtitan#3427; PyTorch fixes it the same way in a
    release after 2.13). The ranges compute nothing, so SAC ignoring them changes no value.
    `SAC_IGNORED_OPS` is public (`torch.utils.checkpoint.__all__`).
    """
    from torch.utils import checkpoint

    profiler = torch.ops.profiler
    for packet in (
        profiler._record_function_enter,
        profiler._record_function_enter_new,
        profiler._record_function_exit,
    ):
        checkpoint.SAC_IGNORED_OPS.update(getattr(packet, name) for name in packet.overloads())


def _op_sac_context():
    """A fresh pair of SAC contexts for one checkpointed forward (and its recompute).

    Matmuls are counted separately in the forward and in the recompute so both make the same
    decision for the k-th matmul: even-numbered ones are saved, odd-numbered ones recomputed.
    Module-level (not a lambda) because torch.compile cannot trace a nested `context_fn`.
    """
    _ignore_profiler_ops_in_sac()
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _SAVE_ALWAYS:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return (
                CheckpointPolicy.MUST_SAVE
                if counts[key] % 2 == 1
                else CheckpointPolicy.PREFER_RECOMPUTE
            )
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrap(block: nn.Module, mode: str, option: str, layer_idx: int) -> nn.Module:
    # A block that draws random numbers (LoRA adapter dropout) must draw the same ones again
    # when it is recomputed, or its gradients belong to another mask than its output.
    rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules())
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=rng)
    if option == "op":
        return checkpoint_wrapper(
            block, context_fn=functools.partial(_op_sac_context), preserve_rng_state=rng
        )
    every = int(option)
    return checkpoint_wrapper(block, preserve_rng_state=rng) if layer_idx % every == 0 else block


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str = "op") -> None:
    """Wrap each block of `model.layers` (a ModuleDict), and the block of each multi-token
    prediction depth (`model.mtp`, if any), in place for activation checkpointing.

    Args:
        mode: "none" (no-op), "full" or "selective".
        selective_ac_option: "op", or an integer N as a string (checkpoint every N-th block).
    Raises:
        ValueError: an unknown mode.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode={mode!r}; valid: none, full, selective")
    layers = cast(nn.ModuleDict, model.layers)
    for i, (name, block) in enumerate(list(layers.items())):
        layers[name] = _wrap(block, mode, selective_ac_option, i)
    # multi-token prediction depths (DeepSeek-V3): each one's block, numbered after the layers
    depths = getattr(model, "mtp", None)
    for k, depth in enumerate(depths.values() if depths is not None else []):
        depth.block = _wrap(depth.block, mode, selective_ac_option, len(layers) + k)
