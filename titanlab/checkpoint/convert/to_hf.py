"""DCP → Hugging Face: `dcp_to_hf` (the method is in `titanlab.checkpoint.convert`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from titanlab.checkpoint.hf_tokenizer import resolve_tokenizer, write_hf_tokenizer
from titanlab.checkpoint.streaming import (
    MODEL_PREFIX,
    ConversionError,
    DcpModelReader,
    write_safetensors,
)
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.hf_config import special_token_ids

from titanlab.checkpoint.convert.common import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX,
    expected_shapes,
    prepare_out_dir,
    resolve_dcp_model,
    write_json,
)

logger = logging.getLogger(__name__)


def dcp_to_hf(
    dcp_dir: str,
    out_dir: str,
    *,
    model_name: str | None = None,
    flavor: str | None = None,
    model_args: Any = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    max_position_embeddings: int | None = None,
    tokenizer_path: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    merge_lora: bool = False,
) -> Any:
    """Convert the model weights of a titanlab DCP checkpoint into a Hugging Face folder.

    Args:
        dcp_dir: complete DCP folder of any parallel layout (model weights under `model.`).
        out_dir: folder to create (must be empty or absent unless `overwrite`).
        model_name: the family (`model.name`); default: the one in the folder's
            `model_args.json`, else the default family (`model.name`'s default).
        flavor: published flavor the checkpoint was trained as; default: the args stored in
            the folder's `model_args.json` (titanlab writes it with every checkpoint), else
            "debugmodel". The vocab size is taken from the embedding's shape.
        model_args: use these args (of `model_name`) instead (vocab size still from the
            checkpoint).
        dtype: dtype of the written weights (fp32, bf16 or fp16); a router that Hugging Face
            keeps in fp32 (DeepSeek-V3's gate and bias) is written in fp32 whatever `dtype`.
        max_shard_bytes: a shard holds tensors up to this many bytes (one larger tensor gets a
            shard of its own).
        max_position_embeddings: context length written to config.json; default: the model's
            (`max_seq_len` of its args: the flavor's, or the one recorded in model_args.json).
        tokenizer_path: tokenizer.model or tokenizer.json (or its folder) to write the tokenizer
            files from; None: the bundled
            tokenizer when the vocab size is its size, else none; "": none.
        overwrite: remove a non-empty `out_dir` first.
        progress: show a progress bar over bytes on stderr, when it is a terminal.
        merge_lora: the checkpoint is a LoRA run's with its base (the final export): write
            each adapted weight as W + (alpha / r) B A (`titanlab.checkpoint.peft_export.LoraMerger`).
    Returns:
        The model args written to config.json.
    Raises:
        ConversionError / ValueError: one line — missing or incomplete checkpoint, unknown
            flavor, or a tensor missing, unexpected or of the wrong shape (naming it).
    """
    reader = DcpModelReader(dcp_dir)
    if "tok_embeddings.weight" not in reader.tensors:
        raise ConversionError(
            f"DCP checkpoint {dcp_dir!r} has no {MODEL_PREFIX}tok_embeddings.weight"
        )
    family, args, label = resolve_dcp_model(
        dcp_dir, model_name, flavor, model_args, reader.tensors["tok_embeddings.weight"].shape[0]
    )
    adapter = HFStateDictAdapter(args)
    expected = expected_shapes(family, args)
    merger = _lora_merger(reader, dcp_dir, merge_lora)
    for name in reader.tensors:
        if merger is not None and name in merger.adapter_names:
            continue
        if name not in expected:
            raise ConversionError(f"DCP tensor {MODEL_PREFIX}{name} is not a weight of {label}")
    names = [n for n in expected if not adapter.skipped_in_hf(n)]
    for name in names:
        if name not in reader.tensors:
            raise ConversionError(
                f"DCP checkpoint {dcp_dir!r} lacks tensor {MODEL_PREFIX}{name} of {label}"
            )
        if reader.tensors[name].shape != expected[name]:
            raise ConversionError(
                f"DCP tensor {MODEL_PREFIX}{name} has shape {list(reader.tensors[name].shape)} but "
                f"{label} expects {list(expected[name])}; pass the flavor it was trained as"
            )
    tokenizer = resolve_tokenizer(tokenizer_path, args.vocab_size)
    prepare_out_dir(out_dir, overwrite)

    # Plan the shards from the shapes alone, then stream each tensor into its place.
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    hf_to_ours: dict[str, tuple[str, int | None]] = {}
    for name in names:
        for hf_name, expert in adapter.hf_parts(name, expected[name], copies=True):
            shape = expected[name][1:] if expert is not None else expected[name]
            tensor_dtype = adapter.hf_dtype(name, dtype)
            nbytes = torch.Size(shape).numel() * tensor_dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hf_name, shape, tensor_dtype))
            size += nbytes
            hf_to_ours[hf_name] = (name, expert)
    stacked: dict[str, torch.Tensor] = {}  # the one stacked expert tensor being written out

    def blocks_of(hf_name: str) -> Iterator[torch.Tensor]:
        name, expert = hf_to_ours[hf_name]
        if merger is not None and name in merger.pairs:
            yield adapter.to_hf(name, merger.merged(name))[1]
        elif expert is not None:  # one expert's slice; its experts are written one after another
            if name not in stacked:
                stacked.clear()
                stacked[name] = reader.load(name)
            yield stacked[name][expert]
        elif adapter.needs_permutation(name):
            yield adapter.to_hf(name, reader.load(name))[1]
        else:
            yield from reader.row_blocks(name)

    total = sum(torch.Size(s).numel() * d.itemsize for shard in shards for _, s, d in shard)
    weight_map: dict[str, str] = {}
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="to-hf", disable=not progress or None
    ) as bar:
        for k, entries in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, file), entries, blocks_of, bar.update)
            weight_map.update({n: file for n, _, _ in entries})
    bos, eos = (
        (tokenizer.bos_id, tokenizer.eos_id)
        if tokenizer is not None
        else special_token_ids(args.vocab_size)
    )
    write_json(
        os.path.join(out_dir, "config.json"),
        family.hf.to_config(args, dtype, max_position_embeddings or args.max_seq_len, bos, eos),
    )
    write_json(
        os.path.join(out_dir, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": eos}
    )
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out_dir)
    write_json(
        os.path.join(out_dir, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    logger.info(
        "convert: wrote %d tensors (%.1f MB, %d shards) to %s",
        len(weight_map),
        total / 1e6,
        len(shards),
        out_dir,
    )
    return args


def _lora_merger(reader: DcpModelReader, dcp_dir: str, merge_lora: bool):
    """The merger of a LoRA checkpoint's adapters (None without --merge-lora). Raises
    ConversionError for adapters without --merge-lora, which a Hugging Face model cannot hold."""
    from titanlab.checkpoint.peft_export import LoraMerger, adapter_pairs

    if merge_lora:
        return LoraMerger(reader, dcp_dir)
    if adapter_pairs(reader.tensors):
        raise ConversionError(
            f"{dcp_dir!r} holds LoRA adapters: pass --merge-lora to write the merged model "
            "(from the final export-step-N, which has the base), or use to-peft for the adapters"
        )
    return None
