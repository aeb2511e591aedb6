"""Streamed conversion between titanlab DCP checkpoints and Hugging Face folders (any family of
the model registry: `LlamaForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, whose
per-expert tensors are stacked into one titanlab tensor per projection and layer).

`dcp_to_hf` reads the model weights of a DCP checkpoint of any parallel layout (the `model.*`
keys; optimizer and the rest are ignored) one stored chunk at a time, and writes
`model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json`, `config.json`,
`generation_config.json` and, when the tokenizer is known, the tokenizer files. `hf_to_dcp` reads
a Hugging Face folder one tensor at a time and writes a model-only DCP folder of the form
`Checkpointer.save_model_only` writes (`{"model": ..., "train_state": {"step": 0}}`) plus the
model args derived from its config.json (`model_args.json`), which
`checkpoint.initial_load_path` loads. Both directions map names and permute wq/wk (and the
q/k norms) with `titanlab.models.common.hf_adapter`; the config mapping is the family's.

Memory: neither direction holds more than about one tensor (the I/O is in
`titanlab.checkpoint.streaming`); measurements in docs/checkpoint_conversion.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter
from tqdm import tqdm

from titanlab.checkpoint.hf_tokenizer import resolve_tokenizer, write_hf_tokenizer
from titanlab.checkpoint.streaming import (
    MODEL_PREFIX,
    ST_FROM_NAME,
    ConversionError,
    DcpModelReader,
    LazyModelPlanner,
    read_safetensors_tensor,
    write_safetensors,
)
from titanlab.models.common.hf_adapter import HFStateDictAdapter, split_hf_name
from titanlab.models.common.hf_config import special_token_ids
from titanlab.models.registry import (
    DEFAULT_FAMILY,
    ModelFamily,
    family_of_hf_config,
    get_family,
    get_flavor,
    matching_flavor,
)
from titanlab.models.stored_args import HF_FLAVOR, read_model_args, write_model_args

__all__ = [
    "DTYPES",
    "ConversionError",
    "DcpModelReader",
    "dcp_to_hf",
    "expected_shapes",
    "hf_to_dcp",
    "parse_size",
]

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """Bytes in `text`: an int, or a number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB.

    Raises:
        ConversionError: not a positive size.
    """
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            t, mult = t[: -len(unit)], factor
            break
    else:
        mult = 1
    try:
        size = int(float(t) * mult)
    except ValueError:
        size = 0
    if size <= 0:
        raise ConversionError(
            f"size {text!r} is not a positive size; e.g. 5GB, 500MB, 2GiB or bytes"
        )
    return size


def expected_shapes(family: ModelFamily, args: Any) -> dict[str, tuple[int, ...]]:
    """titanlab state-dict names → shapes of a `family` model of `args` (vocab_size resolved),
    in state-dict order; built on the meta device, so no memory."""
    with torch.device("meta"):
        model = family.model_cls(dataclasses.replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def resolve_dcp_model(
    dcp_dir: str, model_name: str | None, flavor: str | None, model_args: Any, vocab: int
) -> tuple[ModelFamily, Any, str]:
    """(family, args with `vocab`, label for messages) of a DCP checkpoint: explicit
    `model_args`, else a named flavor, else the folder's `model_args.json`, else the default family's
    debugmodel."""
    stored = read_model_args(dcp_dir)
    if model_args is not None:
        family, label = get_family(model_name or DEFAULT_FAMILY), "the given model args"
    elif flavor is None and stored is not None:
        family, name, model_args = stored
        label = f"{family.name} model of {dcp_dir}/model_args.json ({name})"
    else:
        family = get_family(model_name or (stored[0].name if stored else DEFAULT_FAMILY))
        flavor = flavor or "debugmodel"
        try:
            model_args, label = get_flavor(family, flavor), f"flavor {flavor!r}"
        except ValueError as e:
            raise ConversionError(str(e)) from None
    args = dataclasses.replace(model_args, vocab_size=vocab)
    args.validate()
    return family, args, label


def _prepare_out_dir(path: str, overwrite: bool) -> None:
    if os.path.isdir(path) and os.listdir(path):
        if not overwrite:
            raise ConversionError(
                f"output folder {path!r} exists and is not empty; "
                "choose a new folder or pass --overwrite"
            )
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)


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
        dtype: dtype of the written weights (fp32, bf16 or fp16).
        max_shard_bytes: a shard holds tensors up to this many bytes (one larger tensor gets a
            shard of its own).
        max_position_embeddings: context length written to config.json; default: the model's
            (`max_seq_len` of its args: the flavor's, or the one recorded in model_args.json).
        tokenizer_path: tokenizer.model or tokenizer.json (or its folder) to write the tokenizer
            files from; None: the bundled
            tokenizer when the vocab size is its size, else none; "": none.
        overwrite: remove a non-empty `out_dir` first.
        progress: show a progress bar over bytes on stderr.
        merge_lora: the checkpoint is a LoRA run's with its base (the final export): write
            each adapted weight as W + (alpha / r) B A (`titanlab.peft.export.LoraMerger`).
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
    _prepare_out_dir(out_dir, overwrite)

    # Plan the shards from the shapes alone, then stream each tensor into its place.
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    hf_to_ours: dict[str, tuple[str, int | None]] = {}
    for name in names:
        for hf_name, expert in adapter.hf_parts(name, expected[name]):
            shape = expected[name][1:] if expert is not None else expected[name]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hf_name, shape, dtype))
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
    with tqdm(total=total, unit="B", unit_scale=True, desc="to-hf", disable=not progress) as bar:
        for k, entries in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, file), entries, blocks_of, bar.update)
            weight_map.update({n: file for n, _, _ in entries})
    bos, eos = (
        (tokenizer.bos_id, tokenizer.eos_id)
        if tokenizer is not None
        else special_token_ids(args.vocab_size)
    )
    _write_json(
        os.path.join(out_dir, "config.json"),
        family.hf.to_config(args, dtype, max_position_embeddings or args.max_seq_len, bos, eos),
    )
    _write_json(
        os.path.join(out_dir, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": eos}
    )
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out_dir)
    _write_json(
        os.path.join(out_dir, _INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map}
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
    from titanlab.peft.export import LoraMerger, adapter_pairs

    if merge_lora:
        return LoraMerger(reader, dcp_dir)
    if adapter_pairs(reader.tensors):
        raise ConversionError(
            f"{dcp_dir!r} holds LoRA adapters: pass --merge-lora to write the merged model "
            "(from the final export-step-N, which has the base), or use to-peft for the adapters"
        )
    return None


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# --- reading a Hugging Face folder and writing DCP -----------------------------------------
def _hf_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, _INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConversionError(
            f"Hugging Face folder {hf_dir!r} has no .safetensors weights "
            "(.bin / .pth files are not read; download the safetensors files)"
        )
    return files


def _args_from_hf(cfg: dict, flavor: str | None, model_args: Any) -> tuple[ModelFamily, Any]:
    """(family, args) a config.json describes; with `flavor` / `model_args`, also checks that
    the config has that architecture (vocab size aside)."""
    if not isinstance(cfg, dict):
        raise ConversionError("config.json is not a JSON object")
    family = family_of_hf_config(cfg)
    args = family.hf.from_config(cfg)
    if model_args is None and flavor is None:
        return family, args
    want = model_args if model_args is not None else get_flavor(family, flavor or "")
    want = dataclasses.replace(want, vocab_size=args.vocab_size)
    label = "the given model args" if model_args is not None else f"flavor {flavor!r}"
    mine = family.hf.to_config(args, torch.float32, 1, None, None)
    theirs = family.hf.to_config(want, torch.float32, 1, None, None)
    for key, value in theirs.items():
        if mine.get(key) != value:
            raise ConversionError(
                f"config.json does not match {label}: {key}={mine.get(key)!r} "
                f"(the flavor has {value!r})"
            )
    return family, want


def hf_to_dcp(
    hf_dir: str,
    dcp_dir: str,
    *,
    flavor: str | None = None,
    model_args: Any = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Any:
    """Convert a Hugging Face folder of a registered architecture into a model-only titanlab
    DCP checkpoint.

    The result holds `{"model": <titanlab state dict>, "train_state": {"step": 0}}`, like
    `Checkpointer.save_model_only`, and `model_args.json` with the args derived from
    config.json (any shape of the architecture, not only the published flavors); start training
    from it with `checkpoint.initial_load_path` and `model.flavor = "hf"` (or the flavor it
    matches).

    Args:
        hf_dir: folder with config.json and .safetensors weights (sharded with an index or not).
        dcp_dir: folder to create (must be empty or absent unless `overwrite`).
        flavor: a published flavor the config must match; None: any shape.
        model_args: args the config must match instead of a flavor.
        dtype: dtype to store (None: each tensor's dtype in the HF files). The trainer loads
            any float dtype into its fp32 parameters.
        overwrite: remove a non-empty `dcp_dir` first.
        progress: show a progress bar over bytes on stderr.
    Returns:
        The resolved model args (vocab size from the config).
    Raises:
        ConversionError / ValueError: one line — missing folder or config.json, an unknown
            model_type, a config field the family cannot honour, a config that differs from the
            requested flavor, or an HF tensor missing, unknown or of the wrong shape (naming it).
    """
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"Hugging Face folder {hf_dir!r} has no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    family, args = _args_from_hf(cfg, flavor, model_args)
    name = matching_flavor(family, args) or f"{HF_FLAVOR} ({family.name}, custom shape)"
    adapter = HFStateDictAdapter(args)
    expected = expected_shapes(family, args)

    where: dict[str, tuple[str, str]] = {}  # titanlab name -> (file, HF name)
    experts: dict[str, dict[int, tuple[str, str]]] = {}  # stacked name -> expert -> same
    stored: dict[str, tuple[list[int], torch.dtype]] = {}
    for file in _hf_files(hf_dir):
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise ConversionError(f"Hugging Face folder {hf_dir!r} lacks shard {file}")
        with safe_open(path, framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old exports contain
                if adapter.args.tie_word_embeddings and hf_name == "lm_head.weight":
                    continue  # tied: the embedding is the output projection
                try:
                    ours, expert = split_hf_name(hf_name)
                except ValueError as e:
                    raise ConversionError(str(e)) from None
                sl = f.get_slice(hf_name)
                shape, st_dtype = sl.get_shape(), sl.get_dtype()
                if st_dtype not in ST_FROM_NAME:
                    raise ConversionError(
                        f"HF tensor {hf_name} has dtype {st_dtype}; valid: "
                        f"{', '.join(ST_FROM_NAME)}"
                    )
                want = expected.get(ours)
                if want is None or (expert is not None and not 0 <= expert < want[0]):
                    raise ConversionError(f"HF tensor {hf_name} is not a weight of flavor {name!r}")
                if expert is not None:
                    want = want[1:]
                if tuple(shape) != want:
                    raise ConversionError(
                        f"HF tensor {hf_name} has shape {list(shape)} but flavor "
                        f"{name!r} expects {list(want)} ({ours})"
                    )
                if expert is None:
                    where[ours] = (path, hf_name)
                else:
                    experts.setdefault(ours, {})[expert] = (path, hf_name)
                stored[ours] = (shape, ST_FROM_NAME[st_dtype])
    if args.tie_word_embeddings and "tok_embeddings.weight" in where:
        where["output.weight"] = where["tok_embeddings.weight"]
        stored["output.weight"] = stored["tok_embeddings.weight"]
    for ours in expected:
        if adapter.skipped_in_hf(ours):
            continue  # the MoE expert bias: not in HF files, starts at zero
        for hf_name, expert in adapter.hf_parts(ours, expected[ours]):
            if (ours not in where) if expert is None else (expert not in experts.get(ours, {})):
                raise ConversionError(
                    f"Hugging Face folder {hf_dir!r} lacks tensor {hf_name} of flavor {name!r}"
                )

    def load(ours: str) -> torch.Tensor:
        if ours not in stored:  # the expert bias
            return torch.zeros(expected[ours])
        if ours in experts:
            parts = experts[ours]
            return torch.stack([read_safetensors_tensor(*parts[e], dtype) for e in sorted(parts)])
        path, hf_name = where[ours]
        if adapter.needs_permutation(ours):
            return adapter.from_hf(hf_name, read_safetensors_tensor(path, hf_name, None))[1].to(
                dtype or stored[ours][1]
            )
        return read_safetensors_tensor(path, hf_name, dtype)

    placeholders = {
        ours: torch.zeros((), dtype=dtype or stored.get(ours, ([], torch.float32))[1]).expand(
            expected[ours]
        )
        for ours in expected
    }
    total = sum(p.numel() * p.dtype.itemsize for p in placeholders.values())
    _prepare_out_dir(dcp_dir, overwrite)
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="from-hf", disable=not progress) as bar,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized"
        dcp.save(
            {"model": placeholders, "train_state": {"step": 0}},
            storage_writer=FileSystemWriter(dcp_dir, single_file_per_rank=False),
            planner=LazyModelPlanner(load, bar.update),
            no_dist=True,
        )
    write_model_args(dcp_dir, family, args)
    logger.info(
        "convert: wrote %d tensors (%.1f MB) of flavor %s to %s",
        len(placeholders),
        total / 1e6,
        name,
        dcp_dir,
    )
    return args
