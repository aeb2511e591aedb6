"""Tokenize chat conversations (JSONL of `{"messages": [...]}`) for supervised fine-tuning.

Each conversation is rendered with the chat template (`titanlab.data.chat`), followed by EOS (the
sample separator document masking uses), and stored with a per-token loss mask. Output
directory::

    shard_00000.bin    token ids (uint16 / uint32), samples back to back
    mask_00000.bin     uint8 per token: 1 where the token is a training target
    samples_00000.bin  int64 end offset (exclusive, within the shard) of each sample
    metadata.json      "format": "chat", train_on, dtype, vocab/bos/eos/pad ids, tokenizer
                       fingerprint, totals and the shard list

By default only the assistant's tokens are targets (`train_on="assistant"`); `"all"` trains on
every token but BOS. `titanlab.data.sft_dataset.PackedChatDataset` reads the folder. Every
file is written under a temp name and renamed; metadata.json comes last, so a folder without it
is incomplete.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from titanlab.data.chat import read_chat_jsonl, render_chat
from titanlab.data.prepare import METADATA_FILE, token_dtype, write_json_atomic
from titanlab.data.prepare_inputs import list_input_files
from titanlab.data.tokenizer import Tokenizer, load_tokenizer

CHAT_FORMAT = "chat"
TRAIN_ON = ("assistant", "all")
_SHARD_TOKENS = 1 << 26


def chat_file_names(index: int) -> tuple[str, str, str]:
    """(tokens, mask, sample ends) file names of shard `index`."""
    return f"shard_{index:05d}.bin", f"mask_{index:05d}.bin", f"samples_{index:05d}.bin"


def _write_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    array.tofile(tmp)
    os.replace(tmp, path)


def _samples(
    conversations: list[list[dict[str, str]]], tok: Tokenizer, train_on: str
) -> Iterator[tuple[list[int], list[bool]]]:
    """(ids + EOS, target mask) of each conversation."""
    for messages in conversations:
        rendered = render_chat(tok, messages, add_generation_prompt=False)
        mask = rendered.assistant_mask if train_on == "assistant" else [True] * len(rendered.ids)
        mask[0] = False  # BOS is never a target
        yield [*rendered.ids, tok.eos_id], [*mask, False]


def prepare_chat(
    inputs: list[str],
    output_dir: str,
    tokenizer_path: str,
    *,
    train_on: str = "assistant",
    shard_tokens: int = _SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """Render and tokenize every conversation of `inputs` (JSONL files or folders of them)
    into `output_dir`; returns the metadata written.

    Raises:
        ValueError: `train_on` not in ("assistant", "all"), a tokenizer without the Llama 3
            chat tokens (a tokenizer.json), or a malformed conversation (one line naming the
            file and line: not JSON, no `messages`, an unknown role).
        FileNotFoundError: a missing input or tokenizer.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"--train-on {train_on!r} is not valid; valid: {', '.join(TRAIN_ON)}")
    tok = load_tokenizer(tokenizer_path)
    if not isinstance(tok, Tokenizer):
        raise ValueError(
            f"--format chat renders the Llama 3 chat format, which needs a Llama 3 format "
            f"tokenizer.model; {tokenizer_path!r} is a tokenizer.json"
        )
    # Every conversation is checked before anything is written or drawn.
    conversations = [m for path in list_input_files(inputs) for m in read_chat_jsonl(path)]
    os.makedirs(output_dir, exist_ok=True)
    meta_path = os.path.join(output_dir, METADATA_FILE)
    if os.path.exists(meta_path):
        os.remove(meta_path)  # incomplete until rewritten
    dtype = token_dtype(tok.vocab_size)
    shards: list[dict] = []
    ids: list[int] = []
    mask: list[bool] = []
    ends: list[int] = []

    def flush() -> None:
        index = len(shards)
        names = chat_file_names(index)
        _write_atomic(os.path.join(output_dir, names[0]), np.asarray(ids, dtype=dtype))
        _write_atomic(os.path.join(output_dir, names[1]), np.asarray(mask, dtype=np.uint8))
        _write_atomic(os.path.join(output_dir, names[2]), np.asarray(ends, dtype="<i8"))
        shards.append({"file": names[0], "mask_file": names[1], "samples_file": names[2],
                       "tokens": len(ids), "documents": len(ends),
                       "targets": int(sum(mask))})  # fmt: skip
        ids.clear()
        mask.clear()
        ends.clear()

    for sample_ids, sample_mask in tqdm(_samples(conversations, tok, train_on), desc="chat", unit=" conv",
                                        disable=not progress or None):  # fmt: skip
        ids.extend(sample_ids)
        mask.extend(sample_mask)
        ends.append(len(ids))
        if len(ids) >= shard_tokens:
            flush()
    if ends or not shards:
        flush()
    meta = {
        "format_version": 1,
        "format": CHAT_FORMAT,
        "train_on": train_on,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer_fingerprint": tok.fingerprint,
        "tokenizer_path": tok.path,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "num_shards": len(shards),
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_documents": sum(s["documents"] for s in shards),
        "total_targets": sum(s["targets"] for s in shards),
        "shards": shards,
    }
    write_json_atomic(meta_path, meta)
    return meta
