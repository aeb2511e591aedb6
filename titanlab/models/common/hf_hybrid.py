"""Hugging Face names and row layouts of Qwen3.5's layers (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`), the part `hf_adapter.HFStateDictAdapter` asks about for a model with
linear-attention layers, partial RoPE or a gated attention output.

| titanlab (block of a linear layer) | Hugging Face |
|---|---|
| `attention.wqkv.weight` (rows grouped by key head) | `linear_attn.in_proj_qkv.weight` (all q, all k, all v) |
| `attention.conv.weight` (channels grouped alike) | `linear_attn.conv1d.weight` |
| `attention.wz / wb / wa.weight` | `linear_attn.in_proj_z / in_proj_b / in_proj_a.weight` |
| `attention.decay.A_log / dt_bias` | `linear_attn.A_log / dt_bias` |
| `attention.norm.weight` | `linear_attn.norm.weight` |
| `attention.wo.weight` | `linear_attn.out_proj.weight` |
| `feed_forward.shared_experts.w1 / w2 / w3.weight` (MoE, `shared_gate`) | `mlp.shared_expert.gate_proj / down_proj / up_proj.weight` |
| `feed_forward.shared_gate.weight` | `mlp.shared_expert_gate.weight` |

**Rows.** `linear_attention.GatedDeltaNet` groups the rows of `wqkv` and the convolution's
channels by key head (key head g's query, its key, its H_v / H_k values), so that tensor parallel
can split them contiguously; Hugging Face keeps [all queries; all keys; all values]. With partial
RoPE (`rotary_dim` < head_dim), only the first `rotary_dim` rows of each head's query and key
take the rotate-half reordering of `hf_adapter.permute_to_hf`; with the gated output each head
of `wq` holds 2 · head_dim rows (its query, then its gate: the same layout in both), and only
the query's first `rotary_dim` rows are reordered. The q/k norm weights are reordered like one
head's first `rotary_dim` rows.

Published checkpoints are the multimodal `Qwen3_5ForConditionalGeneration`: their text
weights are named `model.language_model.*` (read as `model.*`); the vision tower and the
multi-token prediction head (`model.visual.*`, `mtp.*`) are left out of an import.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlab.models.common.token_mixer import is_linear_layer

LINEAR_TO_HF = {
    "attention.wqkv.weight": "linear_attn.in_proj_qkv.weight",
    "attention.conv.weight": "linear_attn.conv1d.weight",
    "attention.wz.weight": "linear_attn.in_proj_z.weight",
    "attention.wb.weight": "linear_attn.in_proj_b.weight",
    "attention.wa.weight": "linear_attn.in_proj_a.weight",
    "attention.decay.A_log": "linear_attn.A_log",
    "attention.decay.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.wo.weight": "linear_attn.out_proj.weight",
}
"""Block-relative names of a linear-attention layer's weights."""
SHARED_GATE_TO_HF = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
"""Block-relative names of a gated shared expert (Qwen3.5-MoE's, `MoEArgs.shared_gate`)."""
FROM_HF = {v: k for k, v in [*LINEAR_TO_HF.items(), *SHARED_GATE_TO_HF.items()]}
_LANGUAGE_MODEL = "model.language_model."
_LEFT_OUT = ("model.visual.", "mtp.")


def text_weight_name(hf_name: str) -> str | None:
    """The `Qwen3_5ForCausalLM` name of a weight of a published multimodal checkpoint
    (`model.language_model.X` → `model.X`), the name itself for any other, or None for the
    weights an import leaves out (the vision tower, the multi-token prediction head)."""
    if hf_name.startswith(_LEFT_OUT):
        return None
    if hf_name.startswith(_LANGUAGE_MODEL):
        return "model." + hf_name[len(_LANGUAGE_MODEL) :]
    return hf_name


def _rope_rows(w: torch.Tensor, heads: int, rows: int, rotary: int, to_hf: bool) -> torch.Tensor:
    """Reorder the first `rotary` of each head's `rows` rows between interleaved RoPE pairs
    (titanlab) and rotate-half (HF); w: (heads · per-head rows, cols), any dtype."""
    per_head = w.shape[0] // heads
    out = w.reshape(heads, per_head, -1).clone()
    part = out[:, :rotary]  # (heads, rotary, cols)
    if to_hf:  # titanlab row 2i + s → HF row s · rotary/2 + i
        part = part.reshape(heads, rotary // 2, 2, -1).transpose(1, 2)
    else:
        part = part.reshape(heads, 2, rotary // 2, -1).transpose(1, 2)
    out[:, :rotary] = part.reshape(heads, rotary, -1)
    del rows
    return out.reshape(w.shape)


def _grouped_rows(w: torch.Tensor, key_heads: int, dk: int, v_rows: int, to_hf: bool):
    """Rows of `wqkv` / the convolution between HF's [Q; K; V] and titanlab's grouping by key
    head; w: (2 · H_k · d_k + H_k · v_rows, ...), v_rows = (H_v / H_k) · d_v."""
    keys = key_heads * dk
    if to_hf:
        grouped = w.reshape(key_heads, 2 * dk + v_rows, *w.shape[1:])
        q, k, v = grouped.split([dk, dk, v_rows], dim=1)
        return torch.cat([t.reshape(-1, *w.shape[1:]) for t in (q, k, v)])
    q, k, v = w.split([keys, keys, w.shape[0] - 2 * keys])
    parts = [q.reshape(key_heads, dk, *w.shape[1:]), k.reshape(key_heads, dk, *w.shape[1:])]
    parts.append(v.reshape(key_heads, v_rows, *w.shape[1:]))
    return torch.cat(parts, dim=1).reshape(w.shape)


class HybridLayout:
    """The names and row orders above for one model's args (`of(args)` is None for a model
    without linear layers, partial RoPE or gated attention)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.rotary = getattr(args, "rotary_dim", None) or args.head_dim
        self.gate = getattr(args, "attention_output_gate", False)
        self.shared_gate = getattr(getattr(args, "moe", None), "shared_gate", False)

    @classmethod
    def of(cls, args: Any) -> HybridLayout | None:
        hybrid = getattr(args, "layer_type", None) is not None
        partial = (getattr(args, "rotary_dim", None) or args.head_dim) != args.head_dim
        if hybrid or partial or getattr(args, "attention_output_gate", False):
            return cls(args)
        return None

    def block_hf_name(self, layer: int, rest: str) -> str | None:
        """The HF name (after `model.layers.{layer}.`) of block-relative `rest`, where it
        differs from the other families'; None where it does not."""
        if is_linear_layer(self.args, layer) and rest in LINEAR_TO_HF:
            return LINEAR_TO_HF[rest]
        if self.shared_gate and rest in SHARED_GATE_TO_HF:
            return SHARED_GATE_TO_HF[rest]
        return None

    def permutes(self, layer: int, rest: str) -> bool:
        """Whether block-relative weight `rest` of layer `layer` is reordered between layouts."""
        if is_linear_layer(self.args, layer):
            return rest in ("attention.wqkv.weight", "attention.conv.weight")
        return rest in (
            "attention.wq.weight",
            "attention.wk.weight",
            "attention.q_norm.weight",
            "attention.k_norm.weight",
        )

    def permute(self, layer: int, rest: str, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
        """`w` in the other layout (a new tensor, same shape and dtype)."""
        a = self.args
        if rest in ("attention.wqkv.weight", "attention.conv.weight"):
            v_rows = a.linear_value_heads // a.linear_key_heads * a.linear_value_dim
            return _grouped_rows(w, a.linear_key_heads, a.linear_key_dim, v_rows, to_hf)
        if rest.endswith("norm.weight"):
            return _rope_rows(w.view(-1, 1), 1, a.head_dim, self.rotary, to_hf).view(-1)
        heads = a.n_heads if rest == "attention.wq.weight" else a.kv_heads
        rows = a.head_dim * (2 if self.gate and rest == "attention.wq.weight" else 1)
        return _rope_rows(w, heads, rows, self.rotary, to_hf)
