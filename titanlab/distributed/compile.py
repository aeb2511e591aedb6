"""torch.compile applied from outside the model: each transformer block compiled in place
(`apply_compile`), and how an MoE block compiles (`moe_compile_mode`). Applied by
`titanlab.distributed.parallelize.parallelize_model` after TP, EP and AC, before FSDP."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

from titanlab.config.device_path import device_capability, device_type
from titanlab.config.job_config import JobConfig
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.models.common.decoder import Decoder, moe_layers
from titanlab.models.common.moe import MoE


MOE_COMPILE_MODES = ("whole", "pieces", "eager")
"""How `apply_compile` compiles a block with routed experts (`moe_compile_mode`): "whole", one
graph; "pieces", the graphs between FSDP's (or DDP's) hooks; "eager", its MoE layer eager."""


def moe_compile_mode(
    config: JobConfig, parallel_dims: ParallelDims, device: torch.device, compute_dtype: torch.dtype
) -> str:
    """How an MoE block compiles (`apply_compile`'s `moe`, one of `MOE_COMPILE_MODES`) on
    `device` with parameters computed in `compute_dtype` (`parallelize.param_dtype`).

    Its shapes must not depend on the routing for its MoE layer to compile: the experts run as
    bf16 grouped GEMMs (on a Hopper-class GPU, `grouped_mm_supported`, or anywhere with
    `model.moe_grouped_mm = "on"`; the per-expert loop splits by counts read on the host), and
    the tokens stay on the rank (ep 1) or are exchanged with static splits (a capacity factor,
    `titanlab.distributed.expert_capacity`); tensor parallel's MoE hooks are not traced yet.
    Otherwise "eager". Then "whole" without data parallel, and "pieces" under FSDP or DDP:
    there the router is a unit of its own (fp32, `ROUTER_MP`), and so are expert parallel's
    experts, and their hooks are `torch._dynamo.disable`d, which a full graph cannot call
    ("Attempted to call function marked as skipped", measured in the trainer on CPU, EP 2 ×
    FSDP 2, with and without AC); Dynamo breaks the graph at each and compiles the code between
    (as torchtitan compiles such blocks), but under per-op selective AC, whose eager region
    around the pieces stopped at their first mutating op ("no rule registered for
    HigherOrderOperator auto_functionalized_v2 and mode _CachingTorchDispatchMode", the
    layer's token count, `titanlab.models.common.forward_counts.add_once`; measured on CPU,
    EP 2 × FSDP 2), and under Inductor ran but trained wrong (the loss 0.13 off eager's by
    step 4, bf16, where full AC's pieces stayed within 2e-3): "eager" there. "whole" under any
    activation checkpointing (`apply_compile`)."""
    on_gpu = device_type(device) == "cuda" and device_capability(device) >= (9, 0)
    # bf16 also under "on": torch 2.13's fake kernel of `_grouped_mm`, which Dynamo runs,
    # takes bf16 alone ("Expected inputs of BF16 type"; the CPU's eager kernel takes fp32 too)
    grouped = compute_dtype == torch.bfloat16 and (
        config.model.moe_grouped_mm == "on" or (config.model.moe_grouped_mm == "auto" and on_gpu)
    )
    static = not parallel_dims.ep_enabled or config.parallelism.expert_capacity_factor > 0
    if not (grouped and static) or parallel_dims.tp_enabled:
        return "eager"
    if not (parallel_dims.dp_enabled or parallel_dims.fsdp_enabled):
        return "whole"
    ac = config.activation_checkpoint
    return "eager" if ac.mode == "selective" and ac.selective_ac_option == "op" else "pieces"


def apply_compile(
    model: Decoder,
    backend: str,
    collectives_in_graph: bool = False,
    fullgraph: bool = True,
    inside_checkpoint: bool = False,
    moe: str = "eager",
    overlap_collectives: bool = False,
) -> None:
    """Compile each transformer block in place (`Module.compile`, so parameter names do not
    change and checkpoints stay portable). Blocks are identical, so one graph serves all.

    `collectives_in_graph` (tensor or context parallel): compile afresh, with inductor's on-disk
    FX-graph and AOT-autograd caches off. Those caches keep compiled code with the process-group
    names of its collectives written in, and hand it to a later run whose groups are numbered
    otherwise. Measured here (torch 2.13, CPU): a TP 2 × EP 2 run on 2 ranks given the graph a
    TP 2 × FSDP 2 run had compiled ran its all-gathers over another group, and one step's
    gradients came out up to 5e-4 off eager's with nothing reported; the other way round, the
    run stopped with "Could not resolve the process group registered under the name 4".

    A block with routed experts compiles as `moe` says (`moe_compile_mode`):
    - "eager": the exact token dispatch splits the tokens by data-dependent per-expert counts
      (a graph break for every expert, and a recompile whenever the counts change), so the
      block's attention is compiled whole (`fullgraph=True`), and so is each norm (torch
      modules, whose forward Dynamo compiles only from a frame of titanlab's:
      `compile_forward`; left eager, the two norms of Qwen3-30B-A3B's blocks were 3.1% of its
      step on the ledger's H100 profile, EP 8 on 16 ranks), and the MoE layer (router,
      dispatch, experts) runs eagerly.
    - "whole": the block compiles whole, the MoE layer's routing, permutation, grouped experts,
      combine and shared expert with its norms and attention, around its activation checkpoint
      as a dense block does, so that per-op selective AC's policy is applied inside the graph
      (by AOTAutograd's partitioner; an eager SAC region around compiled code sees no ops to
      keep, and recomputes the whole block). The layer's Python side effects (its aux loss and
      its exchange's state, kept as attributes) are then applied once, after the forward, and
      not again when backward recomputes it (`torch._dynamo.config`
      `.skip_fwd_side_effects_in_bwd_under_checkpoint`; without it Dynamo refuses them: "HOP:
      Unsafe side effect"), which is what the eager layer does too: its counts are added once
      (`titanlab.models.common.forward_counts.add_once`) and its attributes rewritten with
      the same values.
    - "pieces" (FSDP or DDP): the block inside its checkpoint compiles with `fullgraph=False`,
      and Dynamo compiles the code between the router's and the experts' FSDP hooks (which run
      eagerly): attention and norms, the router, the permutation and dispatch, the grouped
      experts, the combine and the residual, each a graph of its own that every block shares;
      the checkpoint runs eagerly around them (compiled around it, a graph break inside the
      checkpoint left the whole block eager: measured, torch 2.13, EP 2 × FSDP 2 under full AC).
    The blocks of multi-token prediction depths (`model.mtp`) compile the same way.

    `overlap_collectives` (expert parallel's exchange in chunks, `expert_dispatch_chunks` > 1):
    Dynamo traces each functional collective's wait right after it, so Inductor's scheduler is
    asked to overlap them (`overlap_in_graph_collectives`): a chunk's all-to-all then runs
    beside the other chunks' experts in the compiled block as in eager code. Raises ValueError
    for a `moe` not in `MOE_COMPILE_MODES`.

    `fullgraph=False` (titanlab's context-parallel attention, whose collectives run eagerly:
    `titanlab.distributed.context_parallel.documents`): each block compiles in the pieces around its
    attention call.

    `inside_checkpoint` (tensor parallel with full AC): a checkpointed dense block compiles its
    inner block, and the checkpoint runs eagerly around the compiled code (recomputing by
    running it again). Compiled around the checkpoint, torch 2.13's AOTAutograd stopped in the
    first forward of a tensor-parallel block: "expected all tensors_saved_with_vc_check to be
    Tensors, got ... DeviceMesh" (measured on CPU, aot_eager and Inductor alike; the mesh that
    the tensor-parallel input hooks pass to `DTensor.from_local` was taken for a saved value of
    the checkpointed region)."""
    if moe not in MOE_COMPILE_MODES:
        raise ValueError(f"moe={moe!r}: expected one of {', '.join(MOE_COMPILE_MODES)}")
    if collectives_in_graph:
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    if overlap_collectives:
        overlap_in_graph_collectives()
    depths = getattr(model, "mtp", None)
    mtp_blocks = [cast(nn.Module, d.block) for d in depths.values()] if depths is not None else []
    for block in [*model.layers.values(), *mtp_blocks]:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if not moe_layers(inner):
            (inner if inside_checkpoint else block).compile(backend=backend, fullgraph=fullgraph)
            continue
        if moe == "whole":
            import torch._dynamo.config

            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
            block.compile(backend=backend, fullgraph=fullgraph)
            continue
        if moe == "pieces":
            inner.compile(backend=backend, fullgraph=False)
            continue
        for child in inner.children():
            if isinstance(child, MoE):
                continue
            if type(child).__module__.startswith("torch."):
                compile_forward(child, backend, fullgraph)
            else:
                child.compile(backend=backend, fullgraph=fullgraph)


def _own_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module`'s class's forward: a frame in titanlab's code, which Dynamo compiles, where
    the forward of a torch module (`nn.RMSNorm`) is in its skip list as a frame of its own."""
    return type(module).forward(module, *args, **kwargs)


_COMPILED_FORWARDS: dict[tuple[str, bool], Any] = {}


def compile_forward(module: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """Compile a torch module's forward in place (`nn.Module.compile` finds no frame to compile
    in one: "frame is in the Dynamo skipfiles list", torch 2.13): its `forward` becomes one
    compiled function shared by every module so compiled (Dynamo guards on the module's type
    and shapes, not its identity: the 2 norms of 48 blocks are one graph), called with the
    module; its hooks and parameter names are unchanged. `titanlab.ledger.regions` counts such
    a module as a compiled region (`forward_compiled`)."""
    key = (backend, fullgraph)
    if key not in _COMPILED_FORWARDS:
        _COMPILED_FORWARDS[key] = torch.compile(_own_forward, backend=backend, fullgraph=fullgraph)
    module.forward = functools.partial(_COMPILED_FORWARDS[key], module)  # type: ignore[method-assign]


def forward_compiled(module: nn.Module) -> bool:
    """Whether `compile_forward` compiled `module`'s forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in _COMPILED_FORWARDS.values()


def overlap_in_graph_collectives() -> None:
    """Have Inductor's scheduler (process-wide) sink every functional collective's wait to the
    first use of its result and issue every collective as soon as its input is ready
    (`reorder_for_compute_comm_overlap` with the `sink_waits` and `raise_comms` passes, torch
    Inductor's `comms.py`), as eager code does with an `AsyncCollectiveTensor`: Dynamo traces
    each wait right after its collective, so without the passes a compiled graph waits for each
    one at once. Measured on an MoE layer exchanged in 2 chunks (CPU, gloo): with both passes,
    chunk 1's dispatch runs beside chunk 0's experts and chunk 0's combine beside chunk 1's, in
    forward, and 3 of the backward's 4 all-to-alls run beside GEMMs, against 1 with
    `sink_waits` alone (`tests/unit/distributed/test_moe_compile.py`)."""
    import torch._inductor.config

    torch._inductor.config.reorder_for_compute_comm_overlap = True
    torch._inductor.config.reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms"]
