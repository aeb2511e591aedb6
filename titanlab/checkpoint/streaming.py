"""Tensor-at-a-time I/O for checkpoint conversion: DCP and safetensors, read and written
without ever holding a whole model.

- `DcpModelReader` reads the model weights of a DCP checkpoint one stored chunk at a time, from
  the offsets in its `.metadata` (`torch.load` straight into the tensor's memory).
- `LazyModelPlanner` lets `dcp.save` plan from zero-memory placeholders and fetch each tensor
  only when it writes it.
- `write_safetensors` writes a safetensors file whose header is planned from shapes alone and
  whose tensors arrive as row blocks; `read_safetensors_tensor` reads (and casts) one tensor.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any, cast

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from titanlab.checkpoint import store

MODEL_PREFIX = "model."
"""Prefix of the model weights in a titanlab DCP checkpoint (`model.layers.0.attention.wq.weight`)."""
ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
}
"""torch dtype → safetensors dtype name."""
ST_FROM_NAME = {v: k for k, v in ST_DTYPES.items()}
BLOCK_BYTES = 64 * 2**20  # dtype conversion works on row blocks of this size


class ConversionError(ValueError):
    """A bad input to the converter; the message is one line naming the bad value."""


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
        if reason and reason.startswith("it is not a DCP checkpoint"):  # never was one
            raise ConversionError(f"{path!r}{reason[2:]}")
        if reason:  # one that was cut off, or torn
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
                    raise ConversionError(
                        f"DCP checkpoint {path!r}: tensor {fqn} is stored with "
                        f"transforms {info.transform_descriptors}; unsupported"
                    )
                chunks.append((tuple(c.offsets), tuple(c.sizes), info))
            self.tensors[fqn[len(MODEL_PREFIX) :]] = _StoredTensor(
                tuple(item.size), item.properties.dtype, chunks
            )
        if not self.tensors:
            raise ConversionError(
                f"DCP checkpoint {path!r} holds no model weights ({MODEL_PREFIX}* keys)"
            )

    def _load_chunk(self, info) -> torch.Tensor:
        with open(os.path.join(self.path, info.relative_path), "rb", buffering=0) as f:
            # a RawIOBase file object; torch.load's stub asks for typing.IO[bytes]
            view = cast(IO[bytes], _FileView(f, info.offset, info.length))
            return torch.load(view, map_location="cpu", weights_only=True)

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor `name` (titanlab name, no prefix) as consecutive row blocks covering it, in its
        stored dtype. Chunks split along dim 0 only (FSDP) are yielded as they are stored; any
        other split (e.g. tensor parallel columns) is assembled into one full tensor first."""
        t = self.tensors[name]
        row_split = all(
            o[1:] == (0,) * (len(t.shape) - 1) and s[1:] == t.shape[1:] for o, s, _ in t.chunks
        )
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


def write_safetensors(
    path: str,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    blocks_of: Callable[[str], Iterator[torch.Tensor]],
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write one safetensors file whose tensors arrive as row blocks, never holding a whole
    shard. The file layout is the safetensors format (github.com/huggingface/safetensors,
    "Format"): an 8-byte little-endian header length N, N bytes of JSON header (names → dtype,
    shape, data_offsets; `__metadata__` {"format": "pt"}) padded with spaces to a multiple of 8,
    then the tensors' bytes back to back. The result is re-opened with `safetensors.safe_open`
    to check it.

    Args:
        entries: (name, shape, dtype) in file order.
        blocks_of: name → iterator of row blocks (any float dtype) covering the tensor in order;
            each is cast to the entry's dtype 64 MiB at a time.
        on_bytes: called with the byte count of each piece written (a progress bar).
    """
    assert sys.byteorder == "little", "safetensors files are little-endian"
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {
            "dtype": ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            written = 0
            for block in blocks_of(name):  # (rows, ...)
                if block.shape[0] == 0:  # an empty FSDP shard
                    continue
                rows = max(1, BLOCK_BYTES // max(1, block[0].numel() * dtype.itemsize))
                for r in range(0, block.shape[0], rows):
                    piece = block[r : r + rows].to(dtype).contiguous()
                    piece_np = piece.view(torch.uint8).numpy()
                    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
                    f.write(memoryview(piece_np).cast("B"))  # type: ignore[arg-type]
                    written += piece.nbytes
                    if on_bytes is not None:
                        on_bytes(piece.nbytes)
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            assert written == want, f"{name}: wrote {written} bytes, expected {want}"
    with safe_open(path, framework="pt") as f:  # the library agrees with the header we wrote
        assert set(f.keys()) == {n for n, _, _ in entries}, f"{path}: unexpected tensor names"


def read_safetensors_tensor(path: str, key: str, dtype: torch.dtype | None) -> torch.Tensor:
    """Tensor `key` of safetensors file `path`, cast to `dtype` (None: as stored).

    A cast is done in 64 MiB row blocks, each read through its own `safe_open` (the library
    maps the file; closing it drops the pages read), so memory holds the result plus one block.

    Raises:
        SafetensorError / OSError: unreadable file.
    """
    with safe_open(path, framework="pt") as f:
        sl = f.get_slice(key)
        shape, stored = sl.get_shape(), ST_FROM_NAME.get(sl.get_dtype())
        if dtype is None or stored == dtype or len(shape) < 2:
            t = f.get_tensor(key)
            return t if dtype is None else t.to(dtype)
    out = torch.empty(shape, dtype=dtype)
    rows = max(1, BLOCK_BYTES // max(1, torch.Size(shape[1:]).numel() * dtype.itemsize))
    for r in range(0, shape[0], rows):
        with safe_open(path, framework="pt") as f:
            out[r : r + rows] = f.get_slice(key)[r : r + rows]
    return out


class LazyModelPlanner(DefaultSavePlanner):
    """A DCP save planner that plans from zero-memory placeholders (`torch.zeros(()).expand(
    shape)`) under `model.` and asks `load_fn(name)` for each real tensor only when DCP writes
    it. With one file per tensor (`FileSystemWriter(single_file_per_rank=False)`) DCP drops each
    tensor once written, so a save holds about one tensor at a time.

    Args:
        load_fn: titanlab name (no `model.` prefix) → the tensor, of the placeholder's shape and
            dtype.
        on_bytes: called with the byte count of each tensor handed to DCP (a progress bar).
    """

    def __init__(self, load_fn, on_bytes=None) -> None:
        super().__init__()
        self._load_fn, self._on_bytes = load_fn, on_bytes

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn.startswith(MODEL_PREFIX):
            tensor = self._load_fn(fqn[len(MODEL_PREFIX) :])
            if self._on_bytes is not None:
                self._on_bytes(tensor.nbytes)
            return tensor
        return super().resolve_data(write_item)
