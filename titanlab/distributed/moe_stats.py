"""The distributed side of MoE training: the load-balance statistics summed over the ranks that
share a global batch, the load-balance gradient's scale, the expert-bias update and the
expert-load metrics. The MoE layers themselves (`titanlab.models.common.moe`) stay plain
PyTorch; these helpers install and drive them from outside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlab.models.common.decoder import moe_layer_args, moe_layers
from titanlab.models.common.moe import MoE


Across = Callable[[torch.Tensor], torch.Tensor]
"""A sum beyond the mesh: fault tolerance's over the replica groups of a step's quorum
(`ReplicaGroup.step_sum`), which stand where HSDP's dp_replicate ranks do."""


def _all_reduce_sum(mesh: DeviceMesh | None, across: Across | None = None):
    group = mesh.get_group() if mesh is not None else None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t
        if group is not None:
            out = t.detach().clone()
            dist.all_reduce(out, group=group)
        return across(out) if across is not None else out

    return reduce


@contextlib.contextmanager
def stats_paused(module: nn.Module) -> Iterator[None]:
    """Within: the MoE layers of `module` record no load statistics, aux loss or aux gradient
    (for forwards that are not training microbatches)."""
    layers = moe_layers(module)
    for moe in layers:
        moe.record_stats = False
    try:
        yield
    finally:
        for moe in layers:
            moe.record_stats = True


def install_stats_reduction(
    model_parts: list[nn.Module], mesh: DeviceMesh | None, across: Across | None = None
) -> None:
    """Make every MoE layer sum its load-balance statistics over `mesh` (the data-parallel
    ranks that share a global microbatch; None: this rank alone), then `across` it."""
    for part in model_parts:
        for moe in moe_layers(part):
            moe.reduce_stats = _all_reduce_sum(mesh, across)


def set_aux_grad_scale(model_parts: list[nn.Module], microbatches: int, avg_ranks: float) -> None:
    """The load-balance gradient's weight: load_balance_coeff / MoE layers / microbatches (the
    loss is the mean over the model's MoE layers and over the step's global microbatches), times
    the ranks FSDP/DDP average gradients over (each rank injects its share of a global sum)."""
    layers = [moe for part in model_parts for moe in moe_layers(part)]
    total = _count_moe_layers(model_parts)
    for moe in layers:
        moe.aux_grad_scale = moe.args.load_balance_coeff * avg_ranks / (total * microbatches)


def _count_moe_layers(model_parts: list[nn.Module]) -> int:
    """MoE layers of the whole model (all pipeline stages): from the args every part holds."""
    args: Any = getattr(model_parts[0], "args")  # noqa: B009 (nn.Module's __getattr__ types)
    return len(moe_layer_args(args))


def end_step(
    model_parts: list[nn.Module],
    mesh: DeviceMesh | None,
    microbatches: int,
    stepped: bool = True,
    across: Across | None = None,
) -> dict[str, torch.Tensor]:
    """After the optimizer step: sum the step's expert loads and aux shares over `mesh` (one
    all-reduce for every layer; then `across` it), update the expert biases, and return the
    metrics of the MoE layers this rank holds as 0-d device tensors (the host fetches them on
    logging steps only):
    for each layer `moe/<layer>/max_load`, `mean_load` (token slots per expert), `aux_loss`
    (mean over the microbatches) and `bias_norm`; plus `moe/aux_loss`, the mean over those
    layers, and under a capacity-bounded expert-parallel dispatch `moe/<layer>/tokens_dropped`
    and `moe/tokens_dropped` (token slots the experts did not run, summed over the ranks and
    layers). Empty for a dense model. `stepped=False` (float16 skipped the optimizer step) leaves
    the expert biases as they are."""
    named = [
        (name.split(".")[1] if name.startswith("layers.") else name, m)
        for part in model_parts
        for name, m in part.named_modules()
        if isinstance(m, MoE)
    ]
    if not named:
        return {}
    stats = torch.cat(
        [
            torch.cat([m.tokens_per_expert, m.step_aux.reshape(1), m.tokens_dropped.reshape(1)])
            for _, m in named
        ]
    )
    stats = _all_reduce_sum(mesh, across)(stats)
    out: dict[str, torch.Tensor] = {}
    offset, auxes, dropped = 0, [], []
    for layer, moe in named:
        n = moe.args.num_experts
        load, aux = stats[offset : offset + n], stats[offset + n] / microbatches
        if hasattr(moe.experts, "record_dropped"):  # a capacity-bounded dispatch
            out[f"moe/{layer}/tokens_dropped"] = stats[offset + n + 1]
            dropped.append(stats[offset + n + 1])
        offset += n + 2
        moe.end_step(load, update_bias=stepped)
        out[f"moe/{layer}/max_load"] = load.max()
        out[f"moe/{layer}/mean_load"] = load.float().mean()
        if moe.args.load_balance_coeff > 0:
            out[f"moe/{layer}/aux_loss"] = aux
            auxes.append(aux)
        if moe.args.bias_update_speed > 0:
            out[f"moe/{layer}/bias_norm"] = moe.expert_bias.detach().norm()
    if auxes:
        out["moe/aux_loss"] = torch.stack(auxes).mean()
    if dropped:
        out["moe/tokens_dropped"] = torch.stack(dropped).sum()
    return out
