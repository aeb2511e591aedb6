"""`parallelize_model`: apply parallelisms and training features to a decoder from outside.

The order is fixed and each step is a small `apply_*` helper taking the model, a mesh and its
own config: tensor parallel → expert parallel → activation checkpointing → torch.compile →
FSDP2/HSDP/DDP. The model
arrives on the meta device and leaves on the meta device; the caller materializes it afterwards
with `to_empty` + `init_weights` (or a checkpoint load).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

try:  # torch >= 2.13; older torch (a GPU image's 2.11) trains every layout but the TP grids
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - only on older torch
    DataParallelMeshDims = None  # type: ignore[assignment,misc]

from titanlab.config.job_config import JobConfig
from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.distributed.context_parallel.documents import own_cp_attention
from titanlab.distributed.activation_offload import apply_offload
from titanlab.distributed.compile import apply_compile, moe_compile_mode
from titanlab.distributed.expert_parallel import apply_ep
from titanlab.distributed.expert_sharding import (
    ExpertSharding,
    block_placement,
    expert_fsdp,
    shard_placement,
)
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.distributed.tensor_parallel.one_d import apply_tp
from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.token_mixer import own_cp_layers
from titanlab.config.device_path import device_type

logger = logging.getLogger("titanlab")

if TYPE_CHECKING:
    from titanlab.models.common.decoder import Decoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROUTER_MP = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
"""MoE routers keep fp32 weights under mixed precision (the router computes in fp32)."""


def param_dtype(config: JobConfig, device: torch.device) -> torch.dtype:
    """Compute dtype of parameters in forward/backward: `training.mixed_precision_param` on
    accelerators, float32 on CPU unless `training.mixed_precision_on_cpu`."""
    if device_type(device) == "cpu" and not config.training.mixed_precision_on_cpu:
        return torch.float32
    return _DTYPES[config.training.mixed_precision_param]


def loss_parallel_enabled(config: JobConfig, parallel_dims: ParallelDims) -> bool:
    """Whether the logits stay sharded on the vocab under tensor parallel (loss parallel): on
    unless `parallelism.disable_loss_parallel`, or when distilling (the KL to the teacher is
    taken over whole-vocab rows, so every tp rank gets the full logits of its tokens) or
    sampling (reinforcement learning samples from whole-vocab rows)."""
    return (
        parallel_dims.tp_enabled
        and config.parallelism.tensor_parallel_mode == "1d"
        and not config.parallelism.disable_loss_parallel
        and not config.distill.teacher_path
        and config.rl.algorithm == "none"
    )


def tp_grid_loss(loss_fn, parallel_dims: ParallelDims):
    """`loss_fn`, or under 2D / 2.5D / 3D tensor parallel the loss of the rows each rank holds,
    summed over the grid (`summa_loss`, `cube_loss`): their heads return only those rows."""
    grid, cube = parallel_dims.mesh("tp_2d"), parallel_dims.mesh("tp_3d")
    if grid is not None:
        from titanlab.distributed.tensor_parallel.two_d import summa_loss

        return summa_loss(loss_fn, grid)
    if cube is not None:
        from titanlab.distributed.tensor_parallel.three_d import cube_loss

        return cube_loss(loss_fn, cube)
    return loss_fn


def parallelize_model(
    model: Decoder, parallel_dims: ParallelDims, config: JobConfig, device: torch.device
) -> Decoder:
    """Apply, in order, TP → EP → AC (and activation offloading) → compile → FSDP2/HSDP/DDP to `model` (the whole model, or
    one pipeline stage of it) in place. Returns the same model object.
    """
    if parallel_dims.tp_enabled and parallel_dims.tp_cube > 1:  # 3D
        from titanlab.distributed.tensor_parallel.three_d import apply_tp_3d

        cube = parallel_dims.mesh("tp_3d")
        assert cube is not None  # built whenever tensor_parallel_mode is 3d
        apply_tp_3d(model, cube, parallel_dims.mesh("dp_tp_grid"))
    elif parallel_dims.tp_enabled and parallel_dims.tp_grid > 1:  # 2D / 2.5D
        from titanlab.distributed.tensor_parallel.two_d import apply_tp_2d

        grid = parallel_dims.mesh("tp_2d")
        assert grid is not None  # built whenever tensor_parallel_mode is 2d
        apply_tp_2d(model, grid, parallel_dims.mesh("dp_tp_grid"))
    elif parallel_dims.tp_enabled:
        f8 = config.float8
        tp_mesh = parallel_dims.mesh("tp")
        assert tp_mesh is not None  # built whenever tp > 1
        apply_tp(
            model,
            tp_mesh,
            loss_parallel=loss_parallel_enabled(config, parallel_dims),
            float8_comm=f8.enable
            and f8.recipe_name == "tensorwise"
            and device_type(device) == "cuda",
            lora=config.peft.method == "lora",
        )
    grouped = {"auto": None, "on": True, "off": False}[config.model.moe_grouped_mm]
    for moe in moe_layers(model):
        moe.experts.use_grouped_mm = grouped
    if parallel_dims.ep_enabled:
        ep_mesh = parallel_dims.mesh("ep")
        assert ep_mesh is not None  # built whenever ep > 1
        apply_ep(model, ep_mesh, config.parallelism.expert_capacity_factor,
                 config.parallelism.expert_dispatch_chunks)  # fmt: skip
    apply_ac(
        model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    )
    if config.activation_checkpoint.offload:
        apply_offload(list(model.layers.values()), device)
    if config.compile.enable and "model" in config.compile.components:
        moe_mode = moe_compile_mode(config, parallel_dims, device, param_dtype(config, device))
        if moe_mode != "eager" and moe_layers(model):
            how = "whole" if moe_mode == "whole" else "in pieces around data parallel's hooks"
            logger.info(f"compile: MoE blocks compiled {how} (routing, exchange, experts, combine)")
        # tensor and context parallel put collectives inside the compiled blocks, and expert
        # parallel's all-to-alls do in a compiled MoE layer
        in_graph = parallel_dims.tp_enabled or parallel_dims.cp > 1
        in_graph |= moe_mode != "eager" and parallel_dims.ep_enabled
        apply_compile(model, config.compile.backend, collectives_in_graph=in_graph,
                      fullgraph=not own_cp_attention(config, own_cp_layers(model.args)),
                      inside_checkpoint=parallel_dims.tp_enabled
                      and config.activation_checkpoint.mode == "full",
                      moe=moe_mode,
                      overlap_collectives=moe_mode != "eager"
                      and config.parallelism.expert_dispatch_chunks > 1)  # fmt: skip
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        dp_mesh = parallel_dims.mesh("dp_replicate")
        assert dp_mesh is not None  # built whenever dp_replicate > 1
        apply_ddp(
            model,
            parallel_dims.mesh("dp_tp_grid") or dp_mesh,
            param_dtype=param_dtype(config, device),
            reduce_dtype=_DTYPES[config.training.mixed_precision_reduce],
            dp_mesh_dims=grid_dp_dims(parallel_dims),
        )
    elif parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            parallel_dims.mesh("dp_tp_grid") or fsdp_mesh(parallel_dims),
            param_dtype=param_dtype(config, device),
            reduce_dtype=_DTYPES[config.training.mixed_precision_reduce],
            cpu_offload=config.training.enable_cpu_offload,
            pin_memory=device.type == "cuda",
            reshard_after_forward=reshard_policy(
                config.parallelism.fsdp_reshard_after_forward,
                pp_enabled=parallel_dims.pp_enabled,
                zero_stage=config.parallelism.zero_stage_in_force,
            ),
            experts=expert_fsdp(parallel_dims, device),
            dp_mesh_dims=grid_dp_dims(parallel_dims),
        )
    return model


def _mesh_dims(dims: DataParallelMeshDims | None) -> dict:
    """`dp_mesh_dims=dims` for fully_shard / replicate, or nothing (torch < 2.13 lacks it)."""
    return {} if dims is None else {"dp_mesh_dims": dims}


def grid_dp_dims(parallel_dims: ParallelDims) -> DataParallelMeshDims | None:
    """Under 2D / 2.5D / 3D tensor parallel with data parallel, which dims of the parameters'
    (dp..., grid...) mesh FSDP2 shards over and which it replicates over (HSDP, DDP); None
    otherwise (FSDP2 then gets a mesh of dp dims only)."""
    if parallel_dims.mesh("dp_tp_grid") is None:
        return None
    return DataParallelMeshDims(
        shard="dp_shard" if parallel_dims.dp_shard > 1 else None,
        replicate="dp_replicate" if parallel_dims.dp_replicate_enabled else None,
    )


def fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: 1D `dp_shard_cp`, or 2D (dp_replicate, dp_shard_cp) for HSDP
    (parameters replicated on dim 0, sharded on dim 1)."""
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.root_slice("dp_replicate", "dp_shard_cp")
    mesh = parallel_dims.mesh("dp_shard_cp")
    assert mesh is not None
    return mesh


def apply_ddp(
    model: Decoder,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> None:
    """Plain data parallel: full parameters on every rank, gradients all-reduced (averaged) per
    block during backward.

    Uses FSDP2's `replicate` (`torch.distributed._composable.replicate_with_fsdp`), applied per
    block and then to the root like `fully_shard`, not the older reducer-based composable DDP:
    `torch.distributed.pipelining` stages recognize FSDP2 modules and all-reduce once after the
    last microbatch, but they do not recognize the older composable DDP, whose reducer then
    all-reduced per microbatch with stale bucket state and trained PP × DDP wrong (|Δloss| 4e-3
    at step 5 against 1 process, measured in torch 2.13).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        for moe in moe_layers(block):
            replicate(moe.router, mesh=dp_mesh, mp_policy=ROUTER_MP)
        replicate(block, mesh=dp_mesh, mp_policy=mp, **_mesh_dims(dp_mesh_dims))
    replicate(model, mesh=dp_mesh, mp_policy=mp, **_mesh_dims(dp_mesh_dims))


def reshard_policy(option: str, pp_enabled: bool, zero_stage: int = 3) -> bool:
    """Whether blocks free their gathered parameters after forward.

    ZeRO stages 1 and 2: no (the parameters stay gathered through backward). Stage 3, by
    `option`: always, never, or default: yes, except under pipeline parallel, where a stage
    runs several microbatches' forwards before their backwards and resharding would all-gather
    again each time.
    """
    if zero_stage in (1, 2) or option == "never":
        return False
    if option == "always":
        return True
    return not pp_enabled


def apply_fsdp(
    model: Decoder,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    pin_memory: bool,
    reshard_after_forward: bool,
    experts: ExpertSharding | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> None:
    """FSDP2 `fully_shard` each block, the final norm + output together, then the root.

    The final norm and output run last in forward and first in backward, so they are never
    resharded after forward. With tied embeddings the shared weight stays with the root.
    An MoE layer's router is its own group with fp32 weights (`ROUTER_MP`); expert-parallel
    experts (`experts` given) are their own group on the expert mesh, each weight sharded on a
    dim that splits evenly (`titanlab.distributed.expert_sharding`). `dp_mesh_dims` (2D / 3D
    tensor parallel): `mesh` is the parameters' (dp..., grid...) mesh and these its dp dims.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    depths: nn.ModuleDict | None = getattr(model, "mtp", None)
    mtp = list(depths.values()) if depths is not None else []
    # Multi-token prediction depths (DeepSeek-V3) are one more unit each, their block inside.
    blocks: list[nn.Module] = [*model.layers.values(), *(cast(nn.Module, m.block) for m in mtp)]
    # Experts that are not expert-parallel ride in their block's unit, over all of `mesh`'s
    # shard ranks: their stacks take a dim that splits evenly there too.
    shard_ranks = mesh.size(mesh.ndim - 1)
    for block in blocks:
        in_block = None
        if experts is None and dp_mesh_dims is None:
            in_block = block_placement(block, shard_ranks)
        for moe in moe_layers(block):
            fully_shard(
                moe.router,
                reshard_after_forward=reshard_after_forward,
                mesh=mesh,
                mp_policy=ROUTER_MP,
                offload_policy=offload,
            )
            if experts is not None:
                fully_shard(
                    moe.experts,
                    reshard_after_forward=reshard_after_forward,
                    mesh=experts.mesh,
                    mp_policy=mp,
                    offload_policy=offload,
                    shard_placement_fn=shard_placement(experts.shard_ranks),
                )
                moe.experts.set_gradient_divide_factor(experts.grad_divide_factor)  # type: ignore[operator]
                moe.experts.set_force_sum_reduction_for_comms(experts.sum_reduce)  # type: ignore[operator]
        fully_shard(
            block,
            reshard_after_forward=reshard_after_forward,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            shard_placement_fn=in_block,
            **_mesh_dims(dp_mesh_dims),
        )
    for depth in mtp:
        fully_shard(
            depth,
            reshard_after_forward=reshard_after_forward,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            **_mesh_dims(dp_mesh_dims),
        )
    tied = (
        model.output is not None
        and model.tok_embeddings is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    if not tied:
        if model.tok_embeddings is not None:
            fully_shard(
                model.tok_embeddings,
                reshard_after_forward=reshard_after_forward,
                mesh=mesh,
                mp_policy=mp,
                offload_policy=offload,
                **_mesh_dims(dp_mesh_dims),
            )
        tail: list[nn.Module] = [m for m in (model.norm, model.output) if m is not None]
        if tail:
            fully_shard(
                tail,
                reshard_after_forward=False,
                mesh=mesh,
                mp_policy=mp,
                offload_policy=offload,
                **_mesh_dims(dp_mesh_dims),
            )
    fully_shard(
        model,
        reshard_after_forward=False,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        **_mesh_dims(dp_mesh_dims),
    )
