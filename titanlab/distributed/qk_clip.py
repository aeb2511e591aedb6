"""MuonClip's QK-clip (Kimi K2, Moonshot AI 2025, arXiv:2507.20534, §2.1):
`optimizer.qk_clip_threshold` τ.

Each training forward records, per attention head h, the largest pre-softmax logit
S_h = max q·kᵀ/√d of the step (`Attention.record_max_logit`). After the optimizer step, a head
whose S_h exceeded τ has its query and key weights rescaled so that the same logits would be
scaled by γ_h = τ / S_h, i.e. fall back to τ; heads at or under τ keep their logits.

With multi-head attention (one key head per query head) that is Kimi K2's rule: W_q^h and W_k^h
each scaled by √γ_h. With multi-head latent attention (DeepSeek-V3), as Kimi K2 does it: the
head's non-rotary query and key rows (of wq / wq_b and of wkv_b) by √γ_h, its rotary query rows
by γ_h, and the rotary key every head shares (wkv_a's) and the value rows not at all. With grouped-query attention a key head g serves a group G(g) of query
heads, so its scale is shared: W_k^g × κ_g with κ_g = √(min_{h∈G(g)} γ_h), and W_q^h ×
γ_h / κ_g. Each head's logits are then scaled by exactly γ_h (a head that did not exceed τ keeps
its logits; its query rows change only where a sibling's did).

Distributed: under FSDP / HSDP / ZeRO, tensor parallel (1D) and pipeline parallel every rank
fills its own layers' and (TP-local) heads' maxima into a (layers, heads) table, and one
all-reduce (max) over all ranks gives every rank every head's S_h (the data-parallel ranks saw
other samples; it is `layers × heads` floats). Each rank then scales the rows of the shard it
holds. The multi-token prediction depths' attention is not clipped. QK-norm models (Qwen3: q
and k are normalized after W_q, W_k, so the rescaling cannot lower the logits), context
parallel, 2D/3D TP, LoRA and compiled activation checkpointing are refused before launch
(`check_qk_clip`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.models.common.attention import Attention
from titanlab.models.common.mla import MLAttention


def check_qk_clip(config: JobConfig, qk_norm: bool) -> None:
    """What QK-clip does not take, refused before launch with one line (ConfigError)."""
    tau = config.optimizer.qk_clip_threshold
    if tau == -1:
        return
    option = f"optimizer.qk_clip_threshold={tau:g}"
    refused = {
        f"model.name={config.model.name} (its QK-norm normalizes q and k after wq and wk, so "
        "rescaling them cannot lower the logits, which the norm already bounds)": qk_norm,
        "parallelism.context_parallel_degree > 1 (a rank sees only its sequence chunk's "
        "logits)": config.parallelism.context_parallel_degree > 1,
        f"parallelism.tensor_parallel_mode={config.parallelism.tensor_parallel_mode}": (
            config.parallelism.tensor_parallel_mode != "1d"
        ),
        "peft.method=lora (the frozen wq and wk would change under the adapters)": (
            config.peft.method == "lora"
        ),
        "compile.enable=true and activation_checkpoint.mode="
        f"{config.activation_checkpoint.mode} (recording the logits inside a compiled "
        "checkpointed block is a side effect Dynamo refuses)": (
            config.compile.enable and config.activation_checkpoint.mode != "none"
        ),
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"{option} with {what} is not supported; use -1 (off)")


def attention_layers(part: nn.Module) -> list[tuple[int, Attention | MLAttention]]:
    """(layer id, attention) of the blocks a model part holds (a pipeline stage keeps the
    global ids as its `layers` keys)."""
    layers = getattr(part, "layers", None)
    if layers is None:
        return []
    return [
        (int(key), block.attention)
        for key, block in layers.items()
        if isinstance(block.attention, Attention | MLAttention)
    ]


def install(model_parts: list[nn.Module]) -> None:
    """Make every attention of `model_parts` record its heads' largest logits."""
    for part in model_parts:
        for _, attn in attention_layers(part):
            attn.record_max_logit = True


@contextlib.contextmanager
def records_paused(module: nn.Module) -> Iterator[None]:
    """Within: the attentions of `module` record nothing (for forwards that are not training
    microbatches, e.g. the pipeline's shape inference on uninitialized tensors)."""
    layers = attention_layers(module)
    was = [a.record_max_logit for _, a in layers]
    for _, a in layers:
        a.record_max_logit = False
    try:
        yield
    finally:
        for (_, a), on in zip(layers, was, strict=True):
            a.record_max_logit = on


def reset(model_parts: list[nn.Module]) -> None:
    """Forget the recorded maxima (before a step's first forward)."""
    for part in model_parts:
        for _, attn in attention_layers(part):
            attn.max_logit = None


def _rows_here(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The entries of `rows` (one per global row of `weight`) for the rows this rank's shard
    holds, as torch's placements split dim 0 (Shard, _StridedShard), in mesh order."""
    if not isinstance(weight, DTensor):
        return rows
    coord = weight.device_mesh.get_coordinate()
    assert coord is not None
    for i, p in enumerate(weight.placements):
        if isinstance(p, Shard | _StridedShard):
            if p.dim % weight.ndim != 0:
                raise ValueError(f"QK-clip: {weight.placements} shards the columns")
            chunks = p._split_tensor(rows, weight.device_mesh.size(i), with_padding=False)[0]
            rows = chunks[coord[i]]
    return rows


def _first_head(weight: torch.Tensor, rows_per_head: int) -> int:
    """The global index of the first head of this rank's tensor-parallel slice of `weight`
    (rows = heads × rows_per_head): its coordinate on the mesh dimension named "tp" times the heads
    per TP rank."""
    if not isinstance(weight, DTensor):
        return 0
    names = weight.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return 0
    tp = names.index("tp")
    coord = weight.device_mesh.get_coordinate()
    assert coord is not None
    return coord[tp] * weight.shape[0] // weight.device_mesh.size(tp) // rows_per_head


def _scale_rows(weight: torch.Tensor, per_row: torch.Tensor) -> None:
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    here = _rows_here(weight, per_row).to(local.dtype)
    local.mul_(here[:, None])


def _query_weight(attn: Attention | MLAttention) -> torch.Tensor:
    if isinstance(attn, Attention):
        return attn.wq.weight
    linear = attn.wq if attn.wq is not None else attn.wq_b
    assert linear is not None
    return linear.weight


def _rows_per_head(attn: Attention | MLAttention) -> int:
    return attn.head_dim if isinstance(attn, Attention) else attn.qk_head_dim


def _rescale(attn: Attention | MLAttention, gamma: torch.Tensor) -> None:
    """Scale the weights so that head h's logits are scaled by gamma[h] ((heads,), global)."""
    if isinstance(attn, Attention):
        kv_heads = attn.wk.weight.shape[0] // attn.head_dim
        kappa = gamma.view(kv_heads, -1).amin(dim=1).sqrt()  # (kv_heads,)
        q_scale = gamma / kappa.repeat_interleave(gamma.numel() // kv_heads)
        _scale_rows(attn.wq.weight, q_scale.repeat_interleave(attn.head_dim))
        _scale_rows(attn.wk.weight, kappa.repeat_interleave(attn.head_dim))
        return
    root = gamma.sqrt()[:, None]
    nope, rope, v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_rows = torch.cat([root.expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1)
    _scale_rows(_query_weight(attn), q_rows.reshape(-1))
    kv_rows = torch.cat([root.expand(-1, nope), torch.ones_like(root).expand(-1, v)], dim=1)
    _scale_rows(attn.wkv_b.weight, kv_rows.reshape(-1))


@torch.no_grad()
def clip(model_parts: list[nn.Module], tau: float, n_layers: int) -> dict[str, torch.Tensor]:
    """Rescale the query and key weights of every head whose recorded logit exceeded `tau` (the
    module docstring), clear the records, and return the metrics: `qk_clip/max_logit` (over the
    model), `qk_clip/layer.<i>/max_logit` (each layer, before clipping) and
    `qk_clip/clipped_heads` (heads rescaled this step), as 0-d float32 tensors."""
    layers = [(i, a) for part in model_parts for i, a in attention_layers(part)]
    if not layers:
        return {}
    some = layers[0][1]
    device = _query_weight(some).device
    n_heads = _query_weight(some).shape[0] // _rows_per_head(some)
    table = torch.full((n_layers, n_heads), float("-inf"), device=device)
    for i, attn in layers:
        if attn.max_logit is not None:
            first = _first_head(_query_weight(attn), _rows_per_head(attn))
            table[i, first : first + attn.max_logit.numel()] = attn.max_logit
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    for i, attn in layers:
        attn.max_logit = None
        s = table[i]
        _rescale(attn, torch.where(s > tau, tau / s, torch.ones_like(s)))
    seen = table.amax(dim=1)
    out = {f"qk_clip/layer.{i}/max_logit": seen[i] for i in range(n_layers)}
    out["qk_clip/max_logit"] = seen.max()
    out["qk_clip/clipped_heads"] = (table > tau).sum().float()  # every stage's layers
    return out
