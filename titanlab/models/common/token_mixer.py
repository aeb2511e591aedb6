"""Which token mixer a decoder block holds, from the family's args: softmax attention (grouped-
query, `attention.Attention`; or multi-head latent, `mla.MLAttention`) or linear attention
(`linear_attention.GatedDeltaNet`, where `args.layer_type(layer_id)` says "linear_attention").

Args switches read here, each with a default that leaves the other families unchanged:
`attention_type` ("mla"), `attention_bias`, `attention_sinks`, `layer_window(layer_id)`,
`attention_output_gate`, `rotary_dim`, `norm_class`, and for linear layers `layer_type` with
`linear_key_heads`, `linear_value_heads`, `linear_key_dim`, `linear_value_dim`,
`linear_conv_kernel`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titanlab.models.common.attention import Attention
from titanlab.models.common.linear_attention import GatedDeltaNet
from titanlab.models.common.mla import MLAttention

TokenMixer = Attention | MLAttention | GatedDeltaNet


def layer_window(args: Any, layer_id: int) -> int | None:
    """The sliding window of block `layer_id` (args with a `layer_window(layer_id)` method,
    gpt-oss), or None: full causal attention."""
    window = getattr(args, "layer_window", None)
    return window(layer_id) if window is not None else None


def has_local_attention(args: Any) -> bool:
    """Whether any block has attention sinks or a sliding window (`local_attention`): on CUDA
    they run FlexAttention with or without documents (`document_mask.attention_masks`)."""
    return getattr(args, "attention_sinks", False) or any(
        layer_window(args, i) is not None for i in range(args.n_layers)
    )


def own_cp_layers(args: Any) -> bool:
    """Whether context parallel must run titanlab's own CP for this model even on a causal
    batch: blocks with sinks or sliding windows (their masks), or linear-attention layers
    (their recurrence over the ranks' pieces in order,
    `titanlab.distributed.context_parallel.linear`)."""
    return has_local_attention(args) or has_linear_layers(args)


def is_linear_layer(args: Any, layer_id: int) -> bool:
    """Whether block `layer_id` mixes tokens by linear attention (args with a
    `layer_type(layer_id)` method returning "linear_attention", Qwen3.5)."""
    layer_type = getattr(args, "layer_type", None)
    return layer_type is not None and layer_type(layer_id) == "linear_attention"


def block_kinds(args: Any) -> list[tuple[int | None, bool]]:
    """Each block's token-mixer kind, (sliding window or None, linear attention or not): the
    blocks of one kind cost alike (the planner's and the memory estimator's unit)."""
    return [(layer_window(args, i), is_linear_layer(args, i)) for i in range(args.n_layers)]


def has_linear_layers(args: Any) -> bool:
    """Whether any block of the model is a linear-attention layer."""
    return any(is_linear_layer(args, i) for i in range(args.n_layers))


def norm_class(args: Any) -> type[nn.Module]:
    """The class of every RMSNorm of the model (blocks, final, q/k): `args.norm_class` (Qwen3.5:
    `norms.ZeroCenteredRMSNorm`), else `nn.RMSNorm`."""
    return getattr(args, "norm_class", nn.RMSNorm)


def rope_dim(args: Any) -> int:
    """The dims of a head RoPE rotates, the tables' width × 2: `args.rotary_dim` (Qwen3.5: a
    quarter of head_dim), else head_dim."""
    return getattr(args, "rotary_dim", None) or args.head_dim


def build_token_mixer(args: Any, layer_id: int) -> TokenMixer:
    """The token mixer of block `layer_id` (module docstring)."""
    if is_linear_layer(args, layer_id):
        return GatedDeltaNet(
            args.dim,
            args.linear_key_heads,
            args.linear_value_heads,
            args.linear_key_dim,
            args.linear_value_dim,
            args.linear_conv_kernel,
            args.norm_eps,
        )
    if getattr(args, "attention_type", "gqa") == "mla":
        return MLAttention(
            args.dim,
            args.n_heads,
            args.q_lora_rank,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            args.softmax_scale,
        )
    return Attention(
        args.dim,
        args.n_heads,
        args.kv_heads,
        args.head_dim,
        args.norm_eps if args.qk_norm else None,
        bias=getattr(args, "attention_bias", False),
        sinks=getattr(args, "attention_sinks", False),
        window=layer_window(args, layer_id),
        output_gate=getattr(args, "attention_output_gate", False),
        rotary_dim=getattr(args, "rotary_dim", None),
        norm_class=norm_class(args),
    )
