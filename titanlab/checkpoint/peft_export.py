"""LoRA adapters out of titanlab: a PEFT adapter folder, or merged into the base weights.

- `dcp_to_peft` writes `adapter_config.json` + `adapter_model.safetensors` in the layout the
  `peft` library loads onto the Hugging Face model (`PeftModel.from_pretrained(hf_base, folder)`;
  PEFT's LoRA docs give the names and config keys). titanlab's `wq` / `wk` rows are in Meta's
  interleaved RoPE order and Hugging Face's in halves (`titanlab.models.common.hf_adapter`), so B
  of a q/k adapter (out × r) gets the same row reordering as the base weight; A is unchanged.
- `LoraMerger` is what `dcp_to_hf(merge_lora=True)` uses: W' = W + (alpha / r) · B A for every
  adapted weight, in fp32, before the Hugging Face reordering.

Both read the adapters from any checkpoint folder of a LoRA run: a step checkpoint (adapters
only) or the final export (base and adapters), and alpha from its `peft.json`.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from titanlab.checkpoint.streaming import ConversionError, DcpModelReader
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.stored_args import read_model_args
from titanlab.peft.lora import is_adapter
from titanlab.peft.stored import PEFT_FILE, read_peft_config

EXPORTABLE = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "wqkv", "wz", "wb", "wa")
"""The adapted Linears an export names: attention, dense MLP, and Qwen3.5's linear-attention
projections (their Hugging Face names from `HFStateDictAdapter`, by layer type)."""
_ADAPTER = re.compile(
    r"^(layers\.\d+\.(?:attention|feed_forward)\.(w\w+)|output)\.lora_([ab])\.weight$"
)


def hf_module(base: str, adapter: HFStateDictAdapter) -> str:
    """The Hugging Face module path of adapted base weight `base` (titanlab name) in the model
    `adapter` maps: `layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj` (in a
    Qwen3.5 linear layer, `layers.0.attention.wo.weight` → `model.layers.0.linear_attn.out_proj`),
    `output.weight` → `lm_head`. Raises ValueError for a layer Hugging Face has no name for."""
    if base == "output.weight":
        return "lm_head"
    return adapter.hf_parts(base, ())[0][0].removesuffix(".weight")


def adapter_pairs(names) -> dict[str, tuple[str, str]]:
    """base weight name → (A name, B name) of every adapter among `names`.

    Raises:
        ConversionError: an adapter of a layer titanlab cannot export (every adapter is
            exported or the command fails: none is dropped), or half a pair.
    """
    found: dict[str, dict[str, str]] = {}
    for name in names:
        if not is_adapter(name):
            continue
        m = _ADAPTER.match(name)
        if m is None or (m.group(2) is not None and m.group(2) not in EXPORTABLE):
            raise ConversionError(
                f"adapter {name}: titanlab exports adapters of attention (wq, wk, wv, wo), "
                "linear attention (wqkv, wz, wb, wa, wo), dense MLP (w1, w2, w3) and output "
                "layers only"
            )
        found.setdefault(f"{m.group(1)}.weight", {})[m.group(3)] = name
    for base, pair in found.items():
        if set(pair) != {"a", "b"}:
            raise ConversionError(f"the checkpoint holds half of the adapter of {base}")
    return {base: (p["a"], p["b"]) for base, p in sorted(found.items())}


def _scaling(dcp_dir: str, rank: int) -> tuple[float, float]:
    """(alpha / rank, dropout) from the folder's peft.json."""
    cfg = read_peft_config(dcp_dir)
    if cfg is None:
        raise ConversionError(
            f"{dcp_dir!r} has LoRA adapters but no {PEFT_FILE} (the LoRA alpha is stored there; "
            "titanlab writes it with every checkpoint of a LoRA run)"
        )
    return cfg.alpha / rank, cfg.dropout


class LoraMerger:
    """The merged weights of the adapted layers of a checkpoint (see the module docstring).

    Raises:
        ConversionError: the folder holds no adapters, or no peft.json.
    """

    def __init__(self, reader: DcpModelReader, dcp_dir: str) -> None:
        self.reader = reader
        self.pairs = adapter_pairs(reader.tensors)
        if not self.pairs:
            raise ConversionError(f"--merge-lora: {dcp_dir!r} holds no LoRA adapters")
        rank = reader.tensors[next(iter(self.pairs.values()))[0]].shape[0]
        self.scaling, _ = _scaling(dcp_dir, rank)
        self.adapter_names = {n for pair in self.pairs.values() for n in pair}

    def merged(self, name: str) -> torch.Tensor:
        """Base weight `name` with its adapter added, fp32 (titanlab layout)."""
        a_name, b_name = self.pairs[name]
        base = self.reader.load(name).float()
        a, b = self.reader.load(a_name).float(), self.reader.load(b_name).float()
        return base + self.scaling * (b @ a)


def dcp_to_peft(dcp_dir: str, out_dir: str, *, overwrite: bool = False) -> int:
    """Write the LoRA adapters of a titanlab checkpoint as a PEFT adapter folder.

    Returns:
        the number of adapted Linear layers.
    Raises:
        ConversionError / ValueError: one line — no adapters, no model_args.json or peft.json,
            or `out_dir` not empty without `overwrite`.
    """
    reader = DcpModelReader(dcp_dir)
    pairs = adapter_pairs(reader.tensors)
    if not pairs:
        raise ConversionError(f"{dcp_dir!r} holds no LoRA adapters (train with peft.method=lora)")
    stored = read_model_args(dcp_dir)
    if stored is None:
        raise ConversionError(f"{dcp_dir!r} has no model_args.json; cannot name its layers")
    _, _, args = stored
    rank = reader.tensors[next(iter(pairs.values()))[0]].shape[0]
    scaling, dropout = _scaling(dcp_dir, rank)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConversionError(f"output folder {out_dir!r} is not empty; pass --overwrite")
    os.makedirs(out_dir, exist_ok=True)
    adapter = HFStateDictAdapter(args)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for base, (a_name, b_name) in pairs.items():
        module = hf_module(base, adapter)
        prefix = f"base_model.model.{module}"
        b = reader.load(b_name).float()
        if adapter.needs_permutation(base):  # q / k: B's rows follow the base's reordering
            b = adapter.to_hf(base, b)[1]
        tensors[f"{prefix}.lora_A.weight"] = reader.load(a_name).float().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
        modules.add(module.rsplit(".", 1)[-1])
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scaling * rank,
        "lora_dropout": dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return len(pairs)
