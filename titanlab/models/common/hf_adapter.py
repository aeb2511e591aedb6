"""The one map between a titanlab decoder's state dict and Hugging Face's `LlamaForCausalLM` /
`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` / `DeepseekV3ForCausalLM` (the same names; Qwen3 adds
the per-head q/k norms, Qwen3-MoE the router and per-expert weights, stacked here, DeepSeek-V3
multi-head latent attention, shared experts and the routing bias).

Used by both directions of `tools/convert_checkpoint.py`, by the trainer's
`checkpoint.last_save_in_hf` and by the tests. Names here are the model's own state-dict names,
without the `model.` prefix that a titanlab DCP checkpoint puts in front of them.

| titanlab | Hugging Face |
|---|---|
| `tok_embeddings.weight` | `model.embed_tokens.weight` |
| `layers.{i}.attention.wq / wk / wv / wo.weight` | `model.layers.{i}.self_attn.q_proj / k_proj / v_proj / o_proj.weight` |
| `layers.{i}.feed_forward.w1 / w2 / w3.weight` | `model.layers.{i}.mlp.gate_proj / down_proj / up_proj.weight` |
| `layers.{i}.attention.q_norm / k_norm.weight` (Qwen3) | `model.layers.{i}.self_attn.q_norm / k_norm.weight` |
| `layers.{i}.attention_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
| `layers.{i}.ffn_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
| `layers.{i}.attention.wq_a / wq_b / wkv_a / wkv_b.weight` (MLA) | `model.layers.{i}.self_attn.q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj.weight` |
| `layers.{i}.attention.q_a_norm / kv_a_norm.weight` (MLA) | `model.layers.{i}.self_attn.q_a_layernorm / kv_a_layernorm.weight` |
| `layers.{i}.feed_forward.router.gate.weight` (MoE) | `model.layers.{i}.mlp.gate.weight` |
| `layers.{i}.feed_forward.experts.w1 / w3 / w2` (MoE, stacked) | `model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight` |
| `layers.{i}.feed_forward.shared_experts.w1 / w2 / w3.weight` | `model.layers.{i}.mlp.shared_experts.gate_proj / down_proj / up_proj.weight` |
| `layers.{i}.feed_forward.expert_bias` (buffer; routing bias in the selection) | `model.layers.{i}.mlp.gate.e_score_correction_bias` |
| `layers.{i}.attention.wq / wk / wv / wo.bias` (gpt-oss) | `model.layers.{i}.self_attn.q_proj / k_proj / v_proj / o_proj.bias` |
| `layers.{i}.attention.sinks.weight` (gpt-oss) | `model.layers.{i}.self_attn.sinks` |
| `layers.{i}.feed_forward.router.gate.weight / bias` (gpt-oss, `MoEArgs.gate_bias`) | `model.layers.{i}.mlp.router.weight / bias` |
| `layers.{i}.feed_forward.experts.gate_up_proj / gate_up_proj_bias / down_proj / down_proj_bias` (gpt-oss, stacked in HF's own layout) | `model.layers.{i}.mlp.experts.gate_up_proj / ...` (the same four names; MXFP4 `*_blocks` / `*_scales` on import) |
| `norm.weight` | `model.norm.weight` |
| `output.weight` | `lm_head.weight` (absent from HF files when the embeddings are tied) |
| Qwen3.5's linear-attention layers and gated shared expert | `common/hf_hybrid.py` |

**RoPE layout.** titanlab (like Meta's reference) rotates the interleaved pairs (2i, 2i+1) of each
head; Hugging Face's `rotate_half` rotates the pairs (i, i + head_dim/2). Both rotate pair i by
the same angle, so the two models agree when the output rows of wq and wk are reordered within
each head: HF row s * head_dim/2 + i holds titanlab row 2i + s (s in {0, 1}). Because q and k get
the same reordering, every q·k score, and so the attention output, is unchanged; wv and wo are
not touched; gpt-oss's q/k biases are reordered with their rows. This is the permutation of Hugging Face's `convert_llama_weights_to_hf.py`
(`view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)`);
`permute_from_hf` is its inverse. wk is reordered over its `n_kv_heads` heads. GQA head order
needs no change: both models let kv head j serve query heads j*n_rep .. (j+1)*n_rep - 1.
The per-head q/k norm weights (head_dim,) get the same reordering as one head's rows: RMSNorm
does not change under a permutation of its inputs when its weight is permuted alike.
Multi-head latent attention needs no reordering: DeepSeek's `rope_interleave` layout rotates the
interleaved pairs like titanlab, and writes them de-interleaved for q and k alike, which leaves
every q·k product unchanged.
"""

from __future__ import annotations

import re

import torch

from titanlab.models.common.decoder import DecoderArgs, moe_layer_args
from titanlab.models.common.hf_hybrid import FROM_HF as _HYBRID_FROM_HF
from titanlab.models.common.hf_hybrid import HybridLayout, text_weight_name
from titanlab.models.common.hf_mtp import MTPNames

_GLOBAL_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TO_HF = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks.weight": "self_attn.sinks",
    "feed_forward.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "feed_forward.experts.gate_up_proj_bias": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.down_proj": "mlp.experts.down_proj",
    "feed_forward.experts.down_proj_bias": "mlp.experts.down_proj_bias",
}
# gpt-oss names its router `mlp.router` (weight and bias), where Qwen3-MoE and DeepSeek-V3 say
# `mlp.gate`: `HFStateDictAdapter` picks by the args (`MoEArgs.gate_bias`).
_ROUTER_TO_HF = {
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
}
# MoE experts: one titanlab tensor (num_experts, out, in) per projection and layer, one HF tensor
# `model.layers.{i}.mlp.experts.{e}.{proj}.weight` (out, in) per expert.
_EXPERT_TO_HF = {
    "feed_forward.experts.w1": "gate_proj",
    "feed_forward.experts.w3": "up_proj",
    "feed_forward.experts.w2": "down_proj",
}
_EXPERT_FROM_HF = {v: k for k, v in _EXPERT_TO_HF.items()}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_GLOBAL_FROM_HF = {v: k for k, v in _GLOBAL_TO_HF.items()}
_LAYER_FROM_HF = {
    **{v: k for k, v in [*_LAYER_TO_HF.items(), *_ROUTER_TO_HF.items()]},
    **_HYBRID_FROM_HF,  # Qwen3.5's linear layers and gated shared expert (`hf_hybrid.py`)
}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_stacked(name: str) -> bool:
    """Whether titanlab tensor `name` stacks one HF tensor per expert along dim 0."""
    m = _OURS_LAYER.match(name)
    return m is not None and m.group(2) in _EXPERT_TO_HF


def expert_hf_name(name: str, expert: int) -> str:
    """HF name of expert `expert`'s slice of stacked titanlab tensor `name`
    (`layers.3.feed_forward.experts.w1`, 5 → `model.layers.3.mlp.experts.5.gate_proj.weight`)."""
    m = _OURS_LAYER.match(name)
    assert m and m.group(2) in _EXPERT_TO_HF, name
    return f"model.layers.{m.group(1)}.mlp.experts.{expert}.{_EXPERT_TO_HF[m.group(2)]}.weight"


def split_hf_name(hf_name: str) -> tuple[str, int | None]:
    """(titanlab name, expert index) of HF weight `hf_name`: the index of a per-expert tensor
    within its stacked titanlab tensor, None for every other weight.

    Raises:
        ValueError: `hf_name` is not a weight of a registered family.
    """
    m = _HF_EXPERT.match(hf_name)
    if m and m.group(3) in _EXPERT_FROM_HF:
        return f"layers.{m.group(1)}.{_EXPERT_FROM_HF[m.group(3)]}", int(m.group(2))
    return from_hf_name(hf_name), None


def to_hf_name(name: str) -> str:
    """Hugging Face name of titanlab state-dict key `name` (e.g. `layers.3.attention.wq.weight`
    → `model.layers.3.self_attn.q_proj.weight`).

    Raises:
        ValueError: `name` is not a decoder weight.
    """
    if name in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[name]
    m = _OURS_LAYER.match(name)
    if m and m.group(2) in _LAYER_TO_HF:
        return f"model.layers.{m.group(1)}.{_LAYER_TO_HF[m.group(2)]}"
    raise ValueError(
        f"{name!r} is not a titanlab decoder weight name; valid: "
        f"{', '.join(_GLOBAL_TO_HF)}, layers.N.{{{', '.join(_LAYER_TO_HF)}}}"
    )


def from_hf_name(hf_name: str) -> str:
    """titanlab state-dict key of Hugging Face weight `hf_name` (inverse of `to_hf_name`).

    Raises:
        ValueError: `hf_name` is not a weight of a registered family (biases, rotary buffers, ...).
    """
    if hf_name in _GLOBAL_FROM_HF:
        return _GLOBAL_FROM_HF[hf_name]
    m = _HF_LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_FROM_HF:
        return f"layers.{m.group(1)}.{_LAYER_FROM_HF[m.group(2)]}"
    raise ValueError(
        f"{hf_name!r} is not a Hugging Face weight name titanlab knows; valid: "
        f"{', '.join(_GLOBAL_FROM_HF)}, model.layers.N.{{{', '.join(_LAYER_FROM_HF)}}}"
    )


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a titanlab wq/wk weight into Hugging Face's rotate-half layout.

    Args:
        w: (n_heads * head_dim, dim) weight, any dtype; head_dim must be even.
        n_heads: heads in `w` (n_heads for wq, n_kv_heads for wk).
    Returns:
        A new contiguous tensor of the same shape and dtype; row s * head_dim/2 + i of each head
        is input row 2i + s (Hugging Face's `convert_llama_weights_to_hf.py` recipe).
    """
    rows, cols = w.shape
    assert rows % (2 * n_heads) == 0, f"{rows} rows do not split into {n_heads} heads of even size"
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_to_hf`: Hugging Face's rotate-half rows back to interleaved pairs.

    Args:
        w: (n_heads * head_dim, dim) weight of q_proj / k_proj, any dtype.
        n_heads: heads in `w` (num_attention_heads for q_proj, num_key_value_heads for k_proj).
    Returns:
        A new contiguous tensor of the same shape and dtype; row 2i + s of each head is input
        row s * head_dim/2 + i.
    """
    rows, cols = w.shape
    assert rows % (2 * n_heads) == 0, f"{rows} rows do not split into {n_heads} heads of even size"
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class HFStateDictAdapter:
    """Converts one tensor, or a whole state dict, between titanlab and Hugging Face.

    Args:
        args: the model's shape; `n_heads` / `kv_heads` drive the RoPE permutation and
            `tie_word_embeddings` whether `output.weight` / `lm_head.weight` is written.
    """

    def __init__(self, args: DecoderArgs) -> None:
        self.args = args
        self._mla = getattr(args, "attention_type", "gqa") == "mla"
        self._route_bias = any(m.route_bias for m in moe_layer_args(args))
        self._router_names = any(m.gate_bias for m in moe_layer_args(args))
        self._mtp = MTPNames(args.n_layers, getattr(args, "mtp_layers", 0))
        self._hybrid = HybridLayout.of(args)

    def _layer_rest(self, name: str) -> tuple[int, str] | None:
        m = _OURS_LAYER.match(self._mtp.block_as_layer(name) or name)
        return (int(m.group(1)), m.group(2)) if m else None

    def _heads(self, name: str) -> int | None:
        if self._hybrid is not None:  # Qwen3.5: `hf_hybrid.HybridLayout.permute`
            where = self._layer_rest(name)
            return 0 if where and self._hybrid.permutes(*where) else None
        if self._mla:
            return None  # DeepSeek's interleaved RoPE layout: no reordering
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            return self.args.n_heads
        if name.endswith(("attention.wk.weight", "attention.wk.bias")):
            return self.args.kv_heads
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1  # one head's worth of weights, shared by every head
        return None

    def needs_permutation(self, name: str) -> bool:
        """True for wq/wk and the q/k norms (titanlab names), whose rows are reordered between
        the layouts."""
        return self._heads(name) is not None

    def _permute(self, name: str, tensor: torch.Tensor, to_hf: bool) -> torch.Tensor:
        heads = self._heads(name)
        if heads is None:
            return tensor
        where = self._layer_rest(name)
        if self._hybrid is not None and where is not None:
            return self._hybrid.permute(where[0], where[1], tensor, to_hf)
        fn = permute_to_hf if to_hf else permute_from_hf
        if tensor.dim() == 1:  # a q/k norm weight (head_dim,), or a bias (heads · head_dim,)
            return fn(tensor.view(-1, 1), heads).view(-1)
        return fn(tensor, heads)

    def skipped_in_hf(self, name: str) -> bool:
        """True when titanlab tensor `name` has no tensor of its own in a Hugging Face folder:
        `output.weight` of a tied model (HF ties `lm_head` to the embedding at load), and the
        MoE expert bias unless it routes every forward (`MoEArgs.route_bias`, DeepSeek-V3's
        `e_score_correction_bias`): otherwise it is auxiliary-loss-free balancing state that
        HF's model does not have."""
        if name.endswith("feed_forward.expert_bias"):
            return not self._route_bias
        return self.args.tie_word_embeddings and name == "output.weight"

    def hf_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype to write titanlab tensor `name` in, for an export in `dtype`: fp32 for the
        router's gate and bias of a model whose bias routes every forward (DeepSeek-V3:
        transformers keeps `mlp.gate.weight` and `e_score_correction_bias` in fp32, and a bias
        rounded to bf16 chooses other experts), else `dtype`."""
        if self._route_bias and name.endswith(
            ("feed_forward.router.gate.weight", "feed_forward.expert_bias")
        ):
            return torch.float32
        return dtype

    def hf_parts(
        self, name: str, shape: tuple[int, ...], copies: bool = False
    ) -> list[tuple[str, int | None]]:
        """(HF name, expert index or None) of each HF tensor titanlab tensor `name` of `shape`
        becomes: one per expert for stacked expert weights, else one; with `copies` (export),
        also the copies of the embedding and head that each MTP depth's layer holds
        (`common/hf_mtp.py`)."""
        layer = self._mtp.block_as_layer(name) or name
        parts: list[tuple[str, int | None]]
        if is_stacked(layer):
            parts = [(expert_hf_name(layer, e), e) for e in range(shape[0])]
        else:
            parts = [(self._hf_name(name), None)]
        if copies:
            parts += [(hf, None) for hf in self._mtp.copies(name)]
        return parts

    def _hf_name(self, name: str) -> str:
        m = _OURS_LAYER.match(name)
        where = self._layer_rest(name)
        if self._hybrid is not None and where is not None:
            block_name = self._hybrid.block_hf_name(*where)
            if block_name is not None:
                return f"model.layers.{where[0]}.{block_name}"
        if self._router_names and m and m.group(2) in _ROUTER_TO_HF:
            return f"model.layers.{m.group(1)}.{_ROUTER_TO_HF[m.group(2)]}"
        own = self._mtp.own_hf_name(name)
        return own if own is not None else to_hf_name(self._mtp.block_as_layer(name) or name)

    def split_hf_name(self, hf_name: str) -> tuple[str | None, int | None]:
        """(titanlab name, expert index or None) of HF weight `hf_name`, as the module-level
        `split_hf_name`, MTP depths' layers included; (None, None) for a depth's copy of the
        embedding or head, which import drops.

        Raises:
            ValueError: `hf_name` is not a weight of a registered family.
        """
        if self._hybrid is not None:  # published Qwen3.5 files: the multimodal model's names
            text_name = text_weight_name(hf_name)
            if text_name is None:
                return None, None
            hf_name = text_name
        depth = self._mtp.depth_of_hf(hf_name)
        if depth is None:
            return split_hf_name(hf_name)
        k, rest = depth
        if self._mtp.is_copy(rest):
            return None, None
        own = self._mtp.own_from_hf(k, rest)
        if own is not None:
            return own, None
        name, expert = split_hf_name(hf_name)
        return self._mtp.block_from_layer(name), expert

    def to_hf(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(HF name, tensor in HF layout) of titanlab weight `name`; shape and dtype kept.

        Raises:
            ValueError: `name` is not a decoder weight.
        """
        return self._hf_name(name), self._permute(name, tensor, to_hf=True)

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(titanlab name, tensor in titanlab layout) of HF weight `hf_name`; shape, dtype kept.

        Raises:
            ValueError: `hf_name` is not a weight of a registered family, or an MTP depth's
                copy of the embedding or head (see `split_hf_name`).
        """
        name, expert = self.split_hf_name(hf_name)
        if name is None or expert is not None:
            raise ValueError(f"{hf_name!r} is not a tensor of its own in titanlab's model")
        return name, self._permute(name, tensor, to_hf=False)

    def to_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole titanlab model state dict in HF names and layout (tied `output.weight` left
        out). Holds every tensor at once: the converter streams with `to_hf` instead."""
        out: dict[str, torch.Tensor] = {}
        for k, v in state_dict.items():
            if self.skipped_in_hf(k):
                continue
            for hf, e in self.hf_parts(k, tuple(v.shape), copies=True):
                out[hf] = v[e] if e is not None else self._permute(k, v, to_hf=True)
        return out

    def from_hf_state_dict(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict in titanlab names and layout. For a tied model
        `output.weight` is the embedding tensor itself (as in titanlab's own state dict), and an
        `lm_head.weight` in the input is ignored."""
        sd: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for k, v in hf_state_dict.items():
            if self.args.tie_word_embeddings and k == "lm_head.weight":
                continue
            name, expert = self.split_hf_name(k)
            if name is None:
                continue  # an MTP depth's copy of the embedding or head
            if expert is None:
                sd.update([self.from_hf(k, v)])
            else:
                experts.setdefault(name, {})[expert] = v
        for name, parts in experts.items():
            sd[name] = torch.stack([parts[e] for e in sorted(parts)])
        if self.args.tie_word_embeddings and "tok_embeddings.weight" in sd:
            sd["output.weight"] = sd["tok_embeddings.weight"]
        return sd
