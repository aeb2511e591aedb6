"""Streamed conversion between titanlab DCP checkpoints and Hugging Face Llama folders.

`dcp_to_hf` reads the model weights of a DCP checkpoint of any parallel layout (the `model.*`
keys; optimizer and the rest are ignored) one stored chunk at a time, and writes
`model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json`, `config.json`,
`generation_config.json` and, when the tokenizer is known, the tokenizer files. `hf_to_dcp` reads
a Hugging Face Llama folder one tensor at a time and writes a model-only DCP folder of the form
`Checkpointer.save_model_only` writes (`{"model": ..., "train_state": {"step": 0}}`), which
`checkpoint.initial_load_path` loads. Both directions map names and permute wq/wk with
`titanlab.checkpoint.hf_adapter`.

Memory: neither direction holds more than about one tensor (the largest stored chunk, plus the
next tensor while DCP finishes writing the previous one) — see docs/checkpoint_conversion.md.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
import struct
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from tqdm import tqdm

from titanlab.checkpoint import store
from titanlab.checkpoint.hf_adapter import HFStateDictAdapter, from_hf_name, to_hf_name
from titanlab.checkpoint.hf_config import (
    DEFAULT_MAX_POSITION_EMBEDDINGS, from_hf_config, generation_config, to_hf_config)
from titanlab.models.llama3.args import TransformerModelArgs, llama3_flavors
from titanlab.models.llama3.model import Transformer

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."
"""Prefix of the model weights in a titanlab DCP checkpoint (`model.layers.0.attention.wq.weight`)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
_ST_FROM_NAME = {v: k for k, v in _ST_DTYPES.items()}
_BLOCK_BYTES = 64 * 2**20  # dtype conversion works on row blocks of this size
_INDEX = "model.safetensors.index.json"


class ConversionError(ValueError):
    """A bad input to the converter; the message is one line naming the bad value."""


def parse_size(text: str) -> int:
    """Bytes in `text`: an int, or a number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB.

    Raises:
        ConversionError: not a positive size.
    """
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
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
        raise ConversionError(f"size {text!r} is not a positive size; e.g. 5GB, 500MB, 2GiB or bytes")
    return size


def _expected_shapes(args: TransformerModelArgs) -> dict[str, tuple[int, ...]]:
    """titanlab state-dict names → shapes of a model of `args`, in state-dict order (meta device)."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _resolve_args(flavor: str, model_args: TransformerModelArgs | None, vocab: int,
                  ) -> TransformerModelArgs:
    if model_args is None:
        if flavor not in llama3_flavors:
            raise ConversionError(f"flavor={flavor!r} is unknown; valid: {', '.join(llama3_flavors)}")
        model_args = llama3_flavors[flavor]
    args = dataclasses.replace(model_args, vocab_size=vocab)
    args.validate()
    return args


def _prepare_out_dir(path: str, overwrite: bool) -> None:
    if os.path.isdir(path) and os.listdir(path):
        if not overwrite:
            raise ConversionError(f"output folder {path!r} exists and is not empty; "
                                  "choose a new folder or pass --overwrite")
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)


# --- reading a DCP checkpoint chunk by chunk ------------------------------------------------
@dataclasses.dataclass
class _StoredTensor:
    """One model tensor of a DCP checkpoint: its full shape and dtype, and where its chunks are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], Any]]  # (offsets, sizes, storage info)


class _FileView(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file, with `readinto`, so that
    `torch.load` reads a stored chunk straight into the tensor's memory."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf).cast("B")[:n])
        self._pos += got
        return got


class DcpModelReader:
    """The model weights of a complete titanlab DCP checkpoint, readable one tensor at a time.

    Args:
        path: a DCP folder (`step-N`, `export-step-N`, or one written by `hf_to_dcp`).
    Raises:
        ConversionError: the folder is missing, incomplete (see `store.incomplete_reason`), or
            holds no `model.*` tensors.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ConversionError(f"DCP checkpoint {path!r} is not a folder")
        reason = store.incomplete_reason(path)
        if reason:
            raise ConversionError(f"DCP checkpoint {path!r} cannot be read: {reason}")
        self.path = path
        md = FileSystemReader(path).read_metadata()
        self.tensors: dict[str, _StoredTensor] = {}
        for fqn, item in md.state_dict_metadata.items():
            if not fqn.startswith(MODEL_PREFIX) or not isinstance(item, TensorStorageMetadata):
                continue
            chunks = []
            for c in item.chunks:
                info = md.storage_data[MetadataIndex(fqn, c.offsets)]
                if getattr(info, "transform_descriptors", None):
                    raise ConversionError(f"DCP checkpoint {path!r}: tensor {fqn} is stored with "
                                          f"transforms {info.transform_descriptors}; unsupported")
                chunks.append((tuple(c.offsets), tuple(c.sizes), info))
            self.tensors[fqn[len(MODEL_PREFIX):]] = _StoredTensor(
                tuple(item.size), item.properties.dtype, chunks)
        if not self.tensors:
            raise ConversionError(f"DCP checkpoint {path!r} holds no model weights "
                                  f"({MODEL_PREFIX}* keys)")

    def _load_chunk(self, info) -> torch.Tensor:
        with open(os.path.join(self.path, info.relative_path), "rb", buffering=0) as f:
            return torch.load(_FileView(f, info.offset, info.length), map_location="cpu",
                              weights_only=True)

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor `name` (titanlab name, no prefix) as consecutive row blocks covering it, in its
        stored dtype. Chunks split along dim 0 only (FSDP) are yielded as they are stored; any
        other split (e.g. tensor parallel columns) is assembled into one full tensor first."""
        t = self.tensors[name]
        row_split = all(o[1:] == (0,) * (len(t.shape) - 1) and s[1:] == t.shape[1:]
                        for o, s, _ in t.chunks)
        if row_split:
            for offsets, _, info in sorted(t.chunks, key=lambda c: c[0]):
                yield self._load_chunk(info)
            return
        yield self.load(name)

    def load(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (titanlab name, no prefix) in its stored dtype."""
        t = self.tensors[name]
        if len(t.chunks) == 1:
            return self._load_chunk(t.chunks[0][2])
        full = torch.empty(t.shape, dtype=t.dtype)
        for offsets, sizes, info in t.chunks:
            view = full
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(self._load_chunk(info))
        return full


# --- writing safetensors shards tensor by tensor --------------------------------------------
def _write_safetensors(path: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                       blocks_of, progress: tqdm) -> None:
    """Write one safetensors file whose tensors arrive as row blocks, never holding a whole
    shard. The file layout is the safetensors format (github.com/huggingface/safetensors,
    "Format"): an 8-byte little-endian header length N, N bytes of JSON header (names → dtype,
    shape, data_offsets; `__metadata__` {"format": "pt"}) padded with spaces to a multiple of 8,
    then the tensors' bytes back to back. The result is re-opened with `safetensors.safe_open`
    to check it.

    Args:
        entries: (name, shape, dtype) in file order.
        blocks_of: name → iterator of row blocks (any float dtype) covering the tensor in order.
    """
    from safetensors import safe_open

    assert sys.byteorder == "little", "safetensors files are little-endian"
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            written = 0
            for block in blocks_of(name):  # (rows, ...) with rows >= 1
                rows = max(1, _BLOCK_BYTES // max(1, block[0].numel() * dtype.itemsize))
                for r in range(0, block.shape[0], rows):
                    piece = block[r:r + rows].to(dtype).contiguous()
                    f.write(memoryview(piece.view(torch.uint8).numpy()).cast("B"))
                    written += piece.nbytes
                    progress.update(piece.nbytes)
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            assert written == want, f"{name}: wrote {written} bytes, expected {want}"
    with safe_open(path, framework="pt") as f:  # the library agrees with the header we wrote
        assert set(f.keys()) == {n for n, _, _ in entries}, f"{path}: unexpected tensor names"


def dcp_to_hf(dcp_dir: str, out_dir: str, *, flavor: str = "debugmodel",
              model_args: TransformerModelArgs | None = None, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
              tokenizer_path: str | None = None, overwrite: bool = False,
              progress: bool = True) -> TransformerModelArgs:
    """Convert the model weights of a titanlab DCP checkpoint into a Hugging Face Llama folder.

    Args:
        dcp_dir: complete DCP folder of any parallel layout (model weights under `model.`).
        out_dir: folder to create (must be empty or absent unless `overwrite`).
        flavor: titanlab flavor the checkpoint was trained as (DCP folders do not store the
            model args); the vocab size is taken from the embedding's shape.
        model_args: use these args instead of `flavor` (vocab size still from the checkpoint).
        dtype: dtype of the written weights (fp32, bf16 or fp16).
        max_shard_bytes: a shard holds tensors up to this many bytes (one larger tensor gets a
            shard of its own).
        max_position_embeddings: context length written to config.json.
        tokenizer_path: tokenizer.model to write the tokenizer files from; None: the bundled
            tokenizer when the vocab size is its size, else none; "": none.
        overwrite: remove a non-empty `out_dir` first.
        progress: show a progress bar over bytes on stderr.
    Returns:
        The model args written to config.json.
    Raises:
        ConversionError / ValueError: one line — missing or incomplete checkpoint, unknown
            flavor, or a tensor missing, unexpected or of the wrong shape (naming it).
    """
    from titanlab.checkpoint.hf_tokenizer import write_hf_tokenizer

    reader = DcpModelReader(dcp_dir)
    if "tok_embeddings.weight" not in reader.tensors:
        raise ConversionError(f"DCP checkpoint {dcp_dir!r} has no {MODEL_PREFIX}tok_embeddings.weight")
    args = _resolve_args(flavor, model_args, reader.tensors["tok_embeddings.weight"].shape[0])
    adapter = HFStateDictAdapter(args)
    expected = _expected_shapes(args)
    label = "the given model args" if model_args is not None else f"flavor {flavor!r}"
    for name in reader.tensors:
        if name not in expected:
            raise ConversionError(f"DCP tensor {MODEL_PREFIX}{name} is not a weight of {label}")
    names = [n for n in expected if not adapter.skipped_in_hf(n)]
    for name in names:
        if name not in reader.tensors:
            raise ConversionError(f"DCP checkpoint {dcp_dir!r} lacks tensor {MODEL_PREFIX}{name} "
                                  f"of {label}")
        if reader.tensors[name].shape != expected[name]:
            raise ConversionError(
                f"DCP tensor {MODEL_PREFIX}{name} has shape {list(reader.tensors[name].shape)} but "
                f"{label} expects {list(expected[name])}; pass the flavor it was trained as")
    _prepare_out_dir(out_dir, overwrite)

    # Plan the shards from the shapes alone, then stream each tensor into its place.
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for name in names:
        nbytes = torch.Size(expected[name]).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((to_hf_name(name), expected[name], dtype))
        size += nbytes
    hf_to_ours = {to_hf_name(n): n for n in names}

    def blocks_of(hf_name: str) -> Iterator[torch.Tensor]:
        name = hf_to_ours[hf_name]
        if adapter.needs_permutation(name):
            yield adapter.to_hf(name, reader.load(name))[1]
        else:
            yield from reader.row_blocks(name)

    total = sum(torch.Size(s).numel() * d.itemsize for shard in shards for _, s, d in shard)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="to-hf", disable=not progress) as bar:
        for k, entries in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(os.path.join(out_dir, file), entries, blocks_of, bar)
            weight_map.update({n: file for n, _, _ in entries})
    _write_json(os.path.join(out_dir, "config.json"),
                to_hf_config(args, dtype=dtype, max_position_embeddings=max_position_embeddings))
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config(args))
    write_hf_tokenizer(tokenizer_path, args.vocab_size, out_dir)
    _write_json(os.path.join(out_dir, _INDEX),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    logger.info("convert: wrote %d tensors (%.1f MB, %d shards) to %s", len(weight_map),
                total / 1e6, len(shards), out_dir)
    return args


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
        raise ConversionError(f"Hugging Face folder {hf_dir!r} has no .safetensors weights "
                              "(.bin / .pth files are not read; download the safetensors files)")
    return files


def _read_hf_tensor(path: str, key: str, dtype: torch.dtype | None) -> torch.Tensor:
    """Tensor `key` of safetensors file `path`, converted to `dtype` (None: as stored) in row
    blocks, so at most one copy of the tensor plus one block is in memory."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        sl = f.get_slice(key)
        shape = sl.get_shape()
        if dtype is None or _ST_FROM_NAME.get(sl.get_dtype()) == dtype or len(shape) < 2:
            t = f.get_tensor(key)
            return t if dtype is None else t.to(dtype)
        out = torch.empty(shape, dtype=dtype)
        rows = max(1, _BLOCK_BYTES // max(1, torch.Size(shape[1:]).numel() * dtype.itemsize))
        for r in range(0, shape[0], rows):
            out[r:r + rows] = sl[r:r + rows]
        return out


class _LazyModelPlanner(DefaultSavePlanner):
    """Plans the DCP save from zero-memory placeholders and reads each model tensor from the
    Hugging Face files only when DCP writes it. With one file per tensor
    (`single_file_per_rank=False`) DCP drops each tensor once written."""

    def __init__(self, load_fn, bar: tqdm) -> None:
        super().__init__()
        self._load_fn, self._bar = load_fn, bar

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn.startswith(MODEL_PREFIX):
            tensor = self._load_fn(fqn[len(MODEL_PREFIX):])
            self._bar.update(tensor.nbytes)
            return tensor
        return super().resolve_data(write_item)


def hf_to_dcp(hf_dir: str, dcp_dir: str, *, flavor: str | None = None,
              model_args: TransformerModelArgs | None = None, dtype: torch.dtype | None = None,
              overwrite: bool = False, progress: bool = True) -> TransformerModelArgs:
    """Convert a Hugging Face Llama folder into a model-only titanlab DCP checkpoint.

    The result holds `{"model": <titanlab state dict>, "train_state": {"step": 0}}`, like
    `Checkpointer.save_model_only`; start training from it with `checkpoint.initial_load_path`.

    Args:
        hf_dir: folder with config.json and .safetensors weights (sharded with an index or not).
        dcp_dir: folder to create (must be empty or absent unless `overwrite`).
        flavor: titanlab flavor the config must match; None: the flavor it matches.
        model_args: check against these args instead of a flavor.
        dtype: dtype to store (None: each tensor's dtype in the HF files). The trainer loads
            any float dtype into its fp32 parameters.
        overwrite: remove a non-empty `dcp_dir` first.
        progress: show a progress bar over bytes on stderr.
    Returns:
        The resolved model args (vocab size from the config).
    Raises:
        ConversionError / ValueError: one line — missing folder or config.json, a config that
            differs from the flavor (naming the key), or an HF tensor missing, unknown or of the
            wrong shape (naming it).
    """
    from safetensors import safe_open

    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"Hugging Face folder {hf_dir!r} has no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    name, args = from_hf_config(cfg, flavor, model_args=model_args)
    adapter = HFStateDictAdapter(args)
    expected = _expected_shapes(args)

    where: dict[str, tuple[str, str]] = {}  # titanlab name -> (file, HF name)
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
                    ours = from_hf_name(hf_name)
                except ValueError as e:
                    raise ConversionError(str(e)) from None
                sl = f.get_slice(hf_name)
                shape, st_dtype = sl.get_shape(), sl.get_dtype()
                if st_dtype not in _ST_FROM_NAME:
                    raise ConversionError(f"HF tensor {hf_name} has dtype {st_dtype}; valid: "
                                          f"{', '.join(_ST_FROM_NAME)}")
                want = expected.get(ours)
                if want is None:
                    raise ConversionError(f"HF tensor {hf_name} is not a weight of flavor {name!r}")
                if tuple(shape) != want:
                    raise ConversionError(f"HF tensor {hf_name} has shape {list(shape)} but flavor "
                                          f"{name!r} expects {list(want)} ({ours})")
                where[ours], stored[ours] = (path, hf_name), (shape, _ST_FROM_NAME[st_dtype])
    if args.tie_word_embeddings and "tok_embeddings.weight" in where:
        where["output.weight"] = where["tok_embeddings.weight"]
        stored["output.weight"] = stored["tok_embeddings.weight"]
    for ours in expected:
        if ours not in where:
            raise ConversionError(f"Hugging Face folder {hf_dir!r} lacks tensor "
                                  f"{to_hf_name(ours)} of flavor {name!r}")

    def load(ours: str) -> torch.Tensor:
        path, hf_name = where[ours]
        if adapter.needs_permutation(ours):
            return adapter.from_hf(hf_name, _read_hf_tensor(path, hf_name, None))[1].to(
                dtype or stored[ours][1])
        return _read_hf_tensor(path, hf_name, dtype)

    placeholders = {ours: torch.zeros((), dtype=dtype or stored[ours][1]).expand(expected[ours])
                    for ours in expected}
    total = sum(p.numel() * p.dtype.itemsize for p in placeholders.values())
    _prepare_out_dir(dcp_dir, overwrite)
    with tqdm(total=total, unit="B", unit_scale=True, desc="from-hf", disable=not progress) as bar, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized"
        dcp.save({"model": placeholders, "train_state": {"step": 0}},
                 storage_writer=FileSystemWriter(dcp_dir, single_file_per_rank=False),
                 planner=_LazyModelPlanner(load, bar), no_dist=True)
    logger.info("convert: wrote %d tensors (%.1f MB) of flavor %s to %s", len(placeholders),
                total / 1e6, name, dcp_dir)
    return args
