"""Streamed export of a titanlab DCP checkpoint to one GGUF file, the format llama.cpp runs.

`dcp_to_gguf` reads the model weights of a checkpoint of any parallel layout one tensor at a
time (like `dcp_to_hf`) and writes them under llama.cpp's tensor names with the metadata its
loader reads (llama.cpp `gguf` docs and `convert_hf_to_gguf.py` for the key names):

| titanlab | GGUF |
|---|---|
| `tok_embeddings.weight` | `token_embd.weight` |
| `layers.{i}.attention_norm.weight` | `blk.{i}.attn_norm.weight` |
| `layers.{i}.attention.wq / wk / wv / wo.weight` | `blk.{i}.attn_q / attn_k / attn_v / attn_output.weight` |
| `layers.{i}.attention.q_norm / k_norm.weight` (Qwen3) | `blk.{i}.attn_q_norm / attn_k_norm.weight` |
| `layers.{i}.ffn_norm.weight` | `blk.{i}.ffn_norm.weight` |
| `layers.{i}.feed_forward.w1 / w3 / w2.weight` | `blk.{i}.ffn_gate / ffn_up / ffn_down.weight` |
| `norm.weight` | `output_norm.weight` |
| `output.weight` | `output.weight` (absent when tied: llama.cpp reuses the embedding) |

**q/k layout.** llama.cpp's `llama` architecture rotates interleaved pairs (its "normal" RoPE),
which is the layout titanlab keeps wq/wk in, so they are written unchanged; its `qwen3`
architecture rotates halves ("NeoX" RoPE), so wq/wk and the q/k norms are written in Hugging
Face's order (`HFStateDictAdapter.to_hf`).

**RoPE scaling.** Llama 3.1 frequency scaling is the `rope_freqs.weight` tensor (fp32, head_dim/2):
per frequency the factor llama.cpp divides it by, unscaled ÷ scaled frequency from
`titanlab.models.common.rope.rope_frequencies`.

**dtypes.** `f32`, `f16`, `bf16`: every matrix in that type. `q8_0`: matrices whose rows are a
multiple of 32 in llama.cpp's 8-bit blocks (32 int8 values and one fp16 scale), others in f16.
Norm weights and `rope_freqs` are always f32, as llama.cpp requires.

The file is written as `OUT.partial` and renamed when complete, so an interrupted export never
leaves a file that looks finished.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from titanlab.checkpoint.convert import resolve_dcp_model
from titanlab.checkpoint.gguf_vocab import GGUFVocab, gguf_vocab
from titanlab.checkpoint.hf_tokenizer import resolve_tokenizer
from titanlab.checkpoint.streaming import MODEL_PREFIX, ConversionError, DcpModelReader
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.rope import rope_frequencies

__all__ = ["GGUF_DTYPES", "dcp_to_gguf", "gguf_tensor_name"]

logger = logging.getLogger(__name__)

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
_ARCH = {"llama3": "llama", "qwen3": "qwen3"}  # titanlab family → llama.cpp architecture
_HALVES_ROPE = {"qwen3"}  # architectures llama.cpp runs with NeoX (rotate-half) RoPE
_GLOBAL = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}
_LAYER = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "attention.q_norm.weight": "attn_q_norm.weight",
    "attention.k_norm.weight": "attn_k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_Q8_BLOCK, _Q8_BLOCK_BYTES = 32, 34  # values per Q8_0 block; bytes per block (32 int8 + fp16)


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of titanlab weight `name` (see the module table).

    Raises:
        ConversionError: a weight GGUF export does not know (e.g. an MoE expert tensor).
    """
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER_NAME.match(name)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ConversionError(f"DCP tensor {MODEL_PREFIX}{name} has no GGUF name")


@dataclass
class _Planned:
    ours: str | None  # titanlab name; None for rope_freqs
    gguf: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType


def _qtype_of(gguf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    q = gguf.GGMLQuantizationType
    if len(shape) == 1 or dtype == "f32":
        return q.F32
    if dtype == "q8_0":
        return q.Q8_0 if shape[-1] % _Q8_BLOCK == 0 else q.F16
    return {"f16": q.F16, "bf16": q.BF16}[dtype]


def _nbytes(gguf: Any, p: _Planned) -> tuple[tuple[int, ...], Any, int]:
    """(shape as given to the writer, numpy dtype, bytes) of a planned tensor."""
    q = gguf.GGMLQuantizationType
    numel = int(np.prod(p.shape))
    if p.qtype == q.Q8_0:
        row = p.shape[-1] // _Q8_BLOCK * _Q8_BLOCK_BYTES
        return (*p.shape[:-1], row), np.uint8, numel // _Q8_BLOCK * _Q8_BLOCK_BYTES
    if p.qtype == q.F32:
        return p.shape, np.float32, numel * 4
    return p.shape, np.float16 if p.qtype == q.F16 else np.uint16, numel * 2


def _to_numpy(gguf: Any, t: torch.Tensor, qtype: Any) -> np.ndarray:
    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        return t.to(torch.float32).contiguous().numpy()
    if qtype == q.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == q.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.asarray(gguf.quants.quantize(t.to(torch.float32).contiguous().numpy(), qtype))


def _add_metadata(w: Any, gguf: Any, args: Any, arch: str, dtype: str, ctx: int) -> None:
    file_type = gguf.LlamaFileType
    w.add_name(f"titanlab {arch}")
    w.add_context_length(ctx)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.n_layers)
    w.add_feed_forward_length(args.ffn_hidden_dim())
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_dimension_count(args.head_dim)
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_layer_norm_rms_eps(float(args.norm_eps))
    w.add_vocab_size(args.vocab_size)
    w.add_file_type(
        {
            "f32": file_type.ALL_F32,
            "f16": file_type.MOSTLY_F16,
            "bf16": file_type.MOSTLY_BF16,
            "q8_0": file_type.MOSTLY_Q8_0,
        }[dtype]
    )
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(w: Any, vocab: GGUFVocab) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        w.add_bos_token_id(vocab.bos_id)
    w.add_add_bos_token(vocab.bos_id is not None)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.eot_id is not None:
        w.add_eot_token_id(vocab.eot_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def dcp_to_gguf(
    dcp_dir: str,
    out_path: str,
    *,
    dtype: str = "f16",
    model_name: str | None = None,
    flavor: str | None = None,
    tokenizer_path: str | None = None,
    max_position_embeddings: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Any:
    """Write the model weights of a titanlab DCP checkpoint as one GGUF file.

    Args:
        dcp_dir: complete DCP folder of any parallel layout (`step-N`, `export-step-N`, or one
            `convert_checkpoint from-hf` wrote).
        out_path: the .gguf file to create (must not exist unless `overwrite`).
        dtype: one of `GGUF_DTYPES` (see the module docstring).
        model_name / flavor: as for `dcp_to_hf` (default: the folder's `model_args.json`).
        tokenizer_path: tokenizer.model / tokenizer.json (or its folder) to embed; None: the
            bundled tokenizer when the vocab size is its size.
        max_position_embeddings: context length written (`{arch}.context_length`); default:
            the model's (`max_seq_len` of its args, as `dcp_to_hf`).
        overwrite: replace an existing `out_path`.
        progress: show a progress bar over bytes on stderr, when it is a terminal.
    Returns:
        The model args written.
    Raises:
        ConversionError / ValueError: one line — the `gguf` package missing, an unknown dtype,
            a family llama.cpp has no architecture for here, no tokenizer, a missing or
            incomplete checkpoint, or an existing output file.
    """
    try:
        import gguf
    except ImportError:
        raise ConversionError(
            "to-gguf needs the gguf package: pip install 'titanlab[gguf]' (or pip install gguf)"
        ) from None
    if dtype not in GGUF_DTYPES:
        raise ConversionError(
            f"--dtype {dtype!r} is not a GGUF type; valid: {', '.join(GGUF_DTYPES)}"
        )
    if os.path.exists(out_path) and not overwrite:
        raise ConversionError(
            f"output file {out_path!r} exists; choose a new name or pass --overwrite"
        )
    reader = DcpModelReader(dcp_dir)
    if "tok_embeddings.weight" not in reader.tensors:
        raise ConversionError(
            f"DCP checkpoint {dcp_dir!r} has no {MODEL_PREFIX}tok_embeddings.weight"
        )
    rows = reader.tensors["tok_embeddings.weight"].shape[0]
    family, args, label = resolve_dcp_model(dcp_dir, model_name, flavor, None, rows)
    arch = _ARCH.get(family.name)
    if arch is None:
        raise ConversionError(
            f"to-gguf supports the families {', '.join(_ARCH)}; {label} is {family.name!r}"
        )
    if arch in _HALVES_ROPE and args.rope_scaling is not None:
        raise ConversionError(f"{label} scales RoPE frequencies, which llama.cpp's {arch} lacks")
    tokenizer = resolve_tokenizer(tokenizer_path, args.vocab_size)
    if tokenizer is None:
        raise ConversionError(
            "a GGUF file needs the model's tokenizer; pass --tokenizer PATH (tokenizer.model "
            "or tokenizer.json)"
        )
    vocab = gguf_vocab(tokenizer, rows)

    adapter = HFStateDictAdapter(args)
    plan: list[_Planned] = []
    for name, t in reader.tensors.items():
        if adapter.skipped_in_hf(name):
            continue  # a tied output.weight
        shape = tuple(t.shape)
        plan.append(_Planned(name, gguf_tensor_name(name), shape, _qtype_of(gguf, dtype, shape)))
    if args.rope_scaling is not None:
        plan.append(
            _Planned(
                None, "rope_freqs.weight", (args.head_dim // 2,), gguf.GGMLQuantizationType.F32
            )
        )

    writer = gguf.GGUFWriter(path=None, arch=arch)
    context = max_position_embeddings or args.max_seq_len
    _add_metadata(writer, gguf, args, arch, dtype, context)
    _add_vocab(writer, vocab)
    total = 0
    for p in plan:
        shape, np_dtype, nbytes = _nbytes(gguf, p)
        writer.add_tensor_info(p.gguf, shape, np.dtype(np_dtype), nbytes, raw_dtype=p.qtype)
        total += nbytes

    def tensor_of(p: _Planned) -> torch.Tensor:
        if p.ours is None:  # the per-frequency factors llama.cpp divides by
            plain = rope_frequencies(args.head_dim, args.rope_theta, None)
            return plain / rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
        t = reader.load(p.ours)
        if arch in _HALVES_ROPE and adapter.needs_permutation(p.ours):
            t = adapter.to_hf(p.ours, t)[1]
        return t

    partial = out_path + ".partial"
    try:
        writer.write_header_to_file(path=Path(partial))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="to-gguf", disable=not progress or None
        ) as bar:
            for p in plan:
                arr = _to_numpy(gguf, tensor_of(p), p.qtype)
                writer.write_tensor_data(arr)
                bar.update(arr.nbytes)
        writer.close()
        os.replace(partial, out_path)
    finally:
        writer.close()
        if os.path.exists(partial):
            os.remove(partial)
    logger.info(
        "convert: wrote %d tensors (%.1f MB, %s) to %s", len(plan), total / 1e6, dtype, out_path
    )
    return args
