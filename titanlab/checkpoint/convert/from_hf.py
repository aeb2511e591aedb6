"""Hugging Face → DCP: `hf_to_dcp` (the method is in `titanlab.checkpoint.convert`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter
from tqdm import tqdm

from titanlab.checkpoint.streaming import (
    ST_FROM_NAME,
    ConversionError,
    LazyModelPlanner,
    read_safetensors_tensor,
)
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.hf_mtp import MTPNames
from titanlab.models.registry import (
    ModelFamily,
    family_of_hf_config,
    get_flavor,
    matching_flavor,
)
from titanlab.models.stored_args import HF_FLAVOR, write_model_args

from titanlab.checkpoint.convert.common import INDEX, expected_shapes, prepare_out_dir
from titanlab.checkpoint.convert.mxfp4_import import Mxfp4Tensors, packed_part

logger = logging.getLogger(__name__)


# --- reading a Hugging Face folder and writing DCP -----------------------------------------
def _hf_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, INDEX)
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


def _holds_mtp(hf_dir: str, files: list[str], depths: MTPNames) -> bool:
    """Whether any of `files` (headers only) holds a tensor of the MTP depths' layers."""
    for file in files:
        path = os.path.join(hf_dir, file)
        if os.path.isfile(path):  # a missing shard is named by the import itself
            with safe_open(path, framework="pt") as f:
                if any(depths.depth_of_hf(k) is not None for k in f.keys()):
                    return True
    return False


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
    mtp: bool = True,
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
        progress: show a progress bar over bytes on stderr, when it is a terminal.
        mtp: import the multi-token prediction depths config.json declares (DeepSeek-V3's
            `num_nextn_predict_layers`, layers num_hidden_layers.. in the files). False: skip
            their tensors and import without them (mtp_layers 0). A folder holding none of
            their tensors (as transformers' `save_pretrained` writes it: its
            DeepseekV3ForCausalLM has no MTP depths) imports without them either way, with one
            warning.
    Returns:
        The resolved model args (vocab size from the config).
    Raises:
        ConversionError / ValueError: one line — missing folder or config.json, an unknown
            model_type, a config field the family cannot honour, a config that differs from the
            requested flavor, or an HF tensor missing, unknown or of the wrong shape (naming it).
    """
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"Hugging Face folder {hf_dir!r} does not exist (or is not a folder)")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"Hugging Face folder {hf_dir!r} has no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    family, args = _args_from_hf(cfg, flavor, model_args)
    files = _hf_files(hf_dir)
    declared = getattr(args, "mtp_layers", 0)
    depths = MTPNames(args.n_layers, declared)  # the layers of the declared MTP depths
    if declared and (not mtp or not _holds_mtp(hf_dir, files, depths)):
        if mtp:
            logger.warning(
                "%s: config.json declares %d multi-token prediction depth(s) "
                "(num_nextn_predict_layers) but the folder holds no tensor of layers %d..%d; "
                "importing without them (mtp_layers 0), as transformers' DeepseekV3ForCausalLM "
                "loads it",
                hf_dir,
                declared,
                args.n_layers,
                args.n_layers + declared - 1,
            )
        args = dataclasses.replace(args, mtp_layers=0)
    skip_mtp = declared > 0 and args.mtp_layers == 0
    name = matching_flavor(family, args) or f"{HF_FLAVOR} ({family.name}, custom shape)"
    adapter = HFStateDictAdapter(args)
    expected = expected_shapes(family, args)

    where: dict[str, tuple[str, str]] = {}  # titanlab name -> (file, HF name)
    experts: dict[str, dict[int, tuple[str, str]]] = {}  # stacked name -> expert -> same
    stored: dict[str, tuple[list[int], torch.dtype]] = {}
    packed = Mxfp4Tensors()  # gpt-oss's MXFP4 experts, dequantized as they are written
    for file in files:
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise ConversionError(f"Hugging Face folder {hf_dir!r} lacks shard {file}")
        with safe_open(path, framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old exports contain
                if skip_mtp and depths.depth_of_hf(hf_name) is not None:
                    continue  # an MTP depth imported without (mtp=False)
                if adapter.args.tie_word_embeddings and hf_name == "lm_head.weight":
                    continue  # tied: the embedding is the output projection
                part = packed_part(hf_name)
                try:
                    name_, expert = adapter.split_hf_name(part[0] if part else hf_name)
                except ValueError as e:
                    raise ConversionError(str(e)) from None
                if part is not None and name_ is not None and name_ in expected:
                    packed.add(name_, *part, path, hf_name, f.get_slice(hf_name).get_shape())
                    continue
                if name_ is None:
                    continue  # an MTP depth's copy of the embedding or head
                ours = name_
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
    for ours in packed.names():
        stored[ours] = (list(packed.shape(ours, expected[ours])), dtype or torch.bfloat16)
    if args.tie_word_embeddings and "tok_embeddings.weight" in where:
        where["output.weight"] = where["tok_embeddings.weight"]
        stored["output.weight"] = stored["tok_embeddings.weight"]
    for ours in expected:
        if adapter.skipped_in_hf(ours):
            continue  # the MoE expert bias: not in HF files, starts at zero
        for hf_name, expert in adapter.hf_parts(ours, expected[ours]):
            if ours in packed:
                continue
            if (ours not in where) if expert is None else (expert not in experts.get(ours, {})):
                depth = depths.depth_of_hf(hf_name) if declared else None
                if depth is not None:
                    raise ConversionError(
                        f"Hugging Face folder {hf_dir!r} lacks tensor {hf_name} of "
                        f"multi-token prediction depth {depth[0]} (layer num_hidden_layers + "
                        f"{depth[0]}; config.json declares {declared} depth(s)); import without "
                        "the depths with convert_checkpoint from-hf --no-mtp (hf_to_dcp(mtp=False))"
                    )
                raise ConversionError(
                    f"Hugging Face folder {hf_dir!r} lacks tensor {hf_name} of flavor {name!r}"
                )

    def load(ours: str) -> torch.Tensor:
        if ours not in stored:  # the expert bias
            return torch.zeros(expected[ours])
        if ours in packed:
            return packed.load(ours, dtype)
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
    prepare_out_dir(dcp_dir, overwrite)
    with (
        tqdm(
            total=total, unit="B", unit_scale=True, desc="from-hf", disable=not progress or None
        ) as bar,
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
