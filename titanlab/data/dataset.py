"""Fixed-length next-token windows over memory-mapped token shards (see :mod:`.prepare`)."""

from __future__ import annotations

import json
import math
import operator
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlab.data.prepare import METADATA_FILE

_SPLITS = ("train", "val")


class MemmapTokenDataset(Dataset):
    """The shards of a prepared directory as one token stream cut into windows of ``seq_len + 1``.

    Window ``w`` covers tokens ``[w * seq_len, w * seq_len + seq_len + 1)`` of the concatenated
    stream, so consecutive windows share one token and there are ``(total_tokens - 1) // seq_len``
    of them. The last ``ceil(val_fraction * windows)`` windows (at least one when
    ``val_fraction > 0``) form the ``"val"`` split, the others the ``"train"`` split. Shards are
    opened read-only with ``np.memmap`` on first access (also after pickling into a worker), so
    nothing is loaded up front.

    Args:
        data_dir: directory with ``metadata.json`` written by ``tools/prepare_data.py``.
        seq_len: tokens per model input.
        split: ``"train"`` or ``"val"``.
        val_fraction: share of windows held out for validation, in ``[0, 1)``.

    Raises:
        FileNotFoundError: no ``metadata.json`` or a shard file is missing.
        ValueError: ``metadata.json`` is not the JSON ``tools/prepare_data.py`` writes, or a
            shard's length differs from what it says.
        ValueError: bad ``seq_len``/``split``/``val_fraction``, a shard of the wrong size, too few
            tokens for one train window, or ``split="val"`` with ``val_fraction=0``.
    """

    def __init__(
        self, data_dir: str, seq_len: int, *, split: str = "train", val_fraction: float = 0.005
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} is invalid; use an integer >= 1")
        if split not in _SPLITS:
            raise ValueError(f"split={split!r} is invalid; use one of {_SPLITS}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} is invalid; use a number in [0, 1)")
        meta_path = os.path.join(data_dir, METADATA_FILE)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(
                f"{meta_path!r} not found; prepare the data first with `titanlab prepare-data`"
            )
        self.metadata = read_metadata(meta_path)
        self.data_dir = data_dir
        self.seq_len = seq_len
        self.split = split
        self.dtype = np.dtype(self.metadata["dtype"]).newbyteorder("<")
        self._paths, counts = [], []
        for shard in self.metadata["shards"]:
            if shard["tokens"] == 0:
                continue  # np.memmap cannot map an empty file
            path = os.path.join(data_dir, shard["file"])
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {path!r} listed in {meta_path!r} is missing")
            expected = shard["tokens"] * self.dtype.itemsize
            if os.path.getsize(path) != expected:
                raise ValueError(
                    f"shard {path!r} has {os.path.getsize(path)} bytes, metadata says {expected}"
                )
            self._paths.append(path)
            counts.append(shard["tokens"])
        self._ends = np.cumsum(counts, dtype=np.int64)  # exclusive end offset of each shard
        self.total_tokens = int(self._ends[-1]) if counts else 0
        self._arrays: list[np.memmap] | None = None

        windows = max(self.total_tokens - 1, 0) // seq_len
        num_val = math.ceil(round(val_fraction * windows, 9)) if val_fraction > 0 else 0
        num_val = max(num_val, 1) if val_fraction > 0 else 0
        num_train = windows - num_val
        if num_train < 1:
            raise ValueError(
                f"{data_dir!r} has {self.total_tokens} tokens, too few for one train window of "
                f"seq_len={seq_len} (+1) with val_fraction={val_fraction}; add data or lower seq_len"
            )
        if split == "val" and num_val == 0:
            raise ValueError("split='val' needs val_fraction > 0")
        self.num_train_windows, self.num_val_windows = num_train, num_val
        self._first_window = 0 if split == "train" else num_train
        self._len = num_train if split == "train" else num_val

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_arrays"] = None  # reopen in the worker instead of pickling the mapped data
        return state

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream (0 <= start < stop <=
        total_tokens), copied out of the shards."""
        if self._arrays is None:
            self._arrays = [np.memmap(p, dtype=self.dtype, mode="r") for p in self._paths]
        shard = int(np.searchsorted(self._ends, start, side="right"))
        pieces = []
        while start < stop:
            shard_start = int(self._ends[shard - 1]) if shard > 0 else 0
            take = min(stop, int(self._ends[shard])) - start
            pieces.append(self._arrays[shard][start - shard_start : start - shard_start + take])
            start += take
            shard += 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(input_ids, labels)``, both int64 of shape ``(seq_len,)``; labels are the
        inputs shifted left by one token. Raises IndexError outside ``[-len, len)``."""
        index = operator.index(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} {self.split} windows")
        start = (self._first_window + index) * self.seq_len
        tokens = torch.from_numpy(
            self.read_tokens(start, start + self.seq_len + 1).astype(np.int64)
        )
        return tokens[:-1], tokens[1:]


_TOKEN_DTYPES = ("uint16", "uint32")


def read_metadata(meta_path: str) -> dict:
    """The parsed ``metadata.json`` of a prepared dataset, checked for the fields the loader
    reads: ``dtype`` (uint16 | uint32) and ``shards`` (a list of ``{"file": str, "tokens": int >=
    0}``). Raises ValueError naming the first problem (one line)."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{meta_path!r} is not valid JSON ({e}); prepare the data again with "
            "`titanlab prepare-data`"
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path!r} holds a JSON {type(meta).__name__}, not an object")
    if meta.get("dtype") not in _TOKEN_DTYPES:
        raise ValueError(
            f"{meta_path!r}: dtype={meta.get('dtype')!r}; valid: {', '.join(_TOKEN_DTYPES)}"
        )
    shards = meta.get("shards")
    if not isinstance(shards, list) or not all(
        isinstance(sh, dict)
        and isinstance(sh.get("file"), str)
        and os.sep not in sh["file"]
        and sh["file"] not in ("", ".", "..")
        and type(sh.get("tokens")) is int
        and sh["tokens"] >= 0
        for sh in shards
    ):
        raise ValueError(
            f'{meta_path!r}: \'shards\' must be a list of {{"file": name, "tokens": '
            "count >= 0}} entries"
        )
    vocab = meta.get("vocab_size")
    if vocab is not None and (type(vocab) is not int or vocab < 1):
        raise ValueError(f"{meta_path!r}: vocab_size={vocab!r} must be a positive integer")
    return meta
