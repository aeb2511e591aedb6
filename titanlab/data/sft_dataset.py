"""Chat SFT samples (a folder `prepare_chat` wrote) as training windows of `seq_len` tokens.

**Packing** (the default): samples, in file order, fill windows of seq_len + 1 tokens greedily;
a sample that does not fit in what is left of a window starts the next one, so no sample is
ever split across windows, and the rest of a window is padding (the tokenizer's pad id, never
a target). The trainer runs packed windows with document masking and restarted positions
(samples end with EOS), so each sample sees only itself, as if it ran alone. A sample longer
than seq_len + 1 is cut to that length (`truncated` counts them). **Without packing** each
window holds one sample.

Each item is (input_ids, labels), int64 (seq_len,): labels are the next tokens, `IGNORE_INDEX`
where the next token is not a target (prompt tokens by default, padding, BOS, EOS). The last
`val_fraction` of the windows form the "val" split.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlab.data.dataset import read_metadata
from titanlab.data.prepare import METADATA_FILE
from titanlab.data.labels import IGNORE_INDEX


def is_chat_folder(data_dir: str) -> bool:
    """Whether `data_dir` holds chat SFT data (`"format": "chat"` in its metadata.json)."""
    path = os.path.join(data_dir, METADATA_FILE)
    return os.path.isfile(path) and read_metadata(path).get("format") == "chat"


class PackedChatDataset(Dataset):
    """See the module docstring.

    Args:
        data_dir: a folder written by `titanlab.data.prepare_chat.prepare_chat`.
        seq_len: tokens per model input.
        split: "train" or "val"; val_fraction: share of windows held out, in [0, 1).
        packing: pack several samples per window (else one per window).
    Raises:
        FileNotFoundError / ValueError: a missing or malformed folder, or too few windows.
    """

    def __init__(
        self,
        data_dir: str,
        seq_len: int,
        *,
        split: str = "train",
        val_fraction: float = 0.005,
        packing: bool = True,
    ) -> None:
        meta_path = os.path.join(data_dir, METADATA_FILE)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{meta_path!r} not found; prepare the data first")
        self.metadata = read_metadata(meta_path)
        if self.metadata.get("format") != "chat":
            raise ValueError(
                f"{data_dir!r} is not chat data (`titanlab prepare-data --format chat`)"
            )
        self.data_dir, self.seq_len, self.split = data_dir, seq_len, split
        self.dtype = np.dtype(self.metadata["dtype"]).newbyteorder("<")
        self.pad_id = int(self.metadata.get("pad_id", self.metadata["eos_id"]))
        starts, ends, shard_of = [], [], []
        for k, shard in enumerate(self.metadata["shards"]):
            sample_ends = np.fromfile(os.path.join(data_dir, shard["samples_file"]), dtype="<i8")
            begins = np.concatenate([[0], sample_ends[:-1]]) if len(sample_ends) else sample_ends
            starts.append(begins)
            ends.append(sample_ends)
            shard_of.append(np.full(len(sample_ends), k, dtype=np.int64))
        self._starts = np.concatenate(starts).astype(np.int64)
        self._ends = np.concatenate(ends).astype(np.int64)
        self._shard = np.concatenate(shard_of)
        lengths = np.minimum(self._ends - self._starts, seq_len + 1)
        self.truncated = int(((self._ends - self._starts) > seq_len + 1).sum())
        self._windows = self._pack(lengths, seq_len + 1, packing)
        windows = len(self._windows)
        num_val = max(1, math.ceil(val_fraction * windows)) if val_fraction > 0 else 0
        if windows - num_val < 1:
            raise ValueError(
                f"{data_dir!r} has {len(lengths)} samples in {windows} windows of "
                f"seq_len={seq_len}, too few for a train window with val_fraction={val_fraction}"
            )
        if split == "val" and num_val == 0:
            raise ValueError("split='val' needs val_fraction > 0")
        self._first = 0 if split == "train" else windows - num_val
        self._len = windows - num_val if split == "train" else num_val
        self._tokens: list[np.memmap] | None = None
        self._masks: list[np.memmap] | None = None

    @staticmethod
    def _pack(lengths: np.ndarray, room: int, packing: bool) -> list[tuple[int, int]]:
        """[first, last) sample ranges of each window, greedily in order."""
        if not packing:
            return [(i, i + 1) for i in range(len(lengths))]
        windows, first, used = [], 0, 0
        for i, n in enumerate(lengths.tolist()):
            if used + n > room and i > first:
                windows.append((first, i))
                first, used = i, 0
            used += n
        if len(lengths) > first:
            windows.append((first, len(lengths)))
        return windows

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = state["_masks"] = None  # reopened in a loader worker
        return state

    def _open(self) -> tuple[list[np.memmap], list[np.memmap]]:
        if self._tokens is None or self._masks is None:
            shards = self.metadata["shards"]
            self._tokens = [
                np.memmap(os.path.join(self.data_dir, s["file"]), dtype=self.dtype, mode="r")
                for s in shards
            ]
            self._masks = [
                np.memmap(os.path.join(self.data_dir, s["mask_file"]), dtype=np.uint8, mode="r")
                for s in shards
            ]
        return self._tokens, self._masks

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} {self.split} windows")
        tokens, masks = self._open()
        room = self.seq_len + 1
        ids = np.full(room, self.pad_id, dtype=np.int64)
        target = np.zeros(room, dtype=bool)
        first, last = self._windows[self._first + index]
        at = 0
        for s in range(first, last):
            k, a = int(self._shard[s]), int(self._starts[s])
            n = min(int(self._ends[s]) - a, room - at)
            ids[at : at + n] = tokens[k][a : a + n]
            target[at : at + n] = masks[k][a : a + n] != 0
            at += n
        labels = np.where(target[1:], ids[1:], IGNORE_INDEX)
        return torch.from_numpy(ids[:-1].copy()), torch.from_numpy(labels)
