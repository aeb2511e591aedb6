"""Tokenize text, JSONL and Parquet files into flat token shards for :mod:`titanlab.data.dataset`.

Output directory layout::

    shard_00000.bin   raw little-endian token ids (uint16 if vocab_size <= 65535, else uint32);
                      every document is BOS + tokens + EOS, documents back to back
    shard_00000.json  {"tokens", "documents", "tokenizer_fingerprint", "inputs", ...}
    metadata.json     format version, dtype, vocab/bos/eos, totals and the shard list

Input files are grouped into shards in sorted order by cumulative size, so the same inputs give the
same shards. A shard's ``.bin`` is written under a temp name and renamed, then its ``.json`` is
written; a rerun keeps every shard whose ``.json`` matches (same tokenizer, same input files with
the same sizes and mtimes, same text key) and whose ``.bin`` has the recorded size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any, cast
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from titanlab.data.prepare_inputs import iter_documents, list_input_files
from titanlab.data.tokenizer import AnyTokenizer, load_tokenizer

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"

_worker_tokenizers: dict[str, AnyTokenizer] = {}


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits in 16 bits (vocab_size <= 65535), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def shard_name(index: int) -> str:
    """File name of shard ``index``'s tokens, e.g. ``shard_00003.bin``."""
    return f"shard_{index:05d}.bin"


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temp file and ``os.replace``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def group_into_shards(files: Sequence[str], shard_size_bytes: int) -> list[list[str]]:
    """Split ``files`` (in order) into groups whose sizes add up to about ``shard_size_bytes``.

    A group is closed once it reaches the target, so a file is never split and a big file may
    make a big shard.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for path in files:
        if size >= shard_size_bytes:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += os.path.getsize(path)
    return groups if groups[0] else []


def _shard_spec(index: int, files: list[str], fingerprint: str, text_key: str) -> dict:
    inputs = []
    for path in files:
        st = os.stat(path)
        inputs.append(
            {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        )
    return {
        "index": index,
        "tokenizer_fingerprint": fingerprint,
        "text_key": text_key,
        "inputs": inputs,
    }


def _is_done(out_dir: str, spec: dict, itemsize: int) -> bool:
    index = spec["index"]
    record = _read_json(os.path.join(out_dir, f"shard_{index:05d}.json"))
    if record is None or any(record.get(k) != v for k, v in spec.items()):
        return False
    bin_path = os.path.join(out_dir, shard_name(index))
    return os.path.isfile(bin_path) and os.path.getsize(bin_path) == record["tokens"] * itemsize


def _tokenize_shard(job: tuple[str, str, dict]) -> dict:
    """Worker: tokenize one shard's files and write its ``.bin`` then ``.json``. Spawn-safe."""
    out_dir, tokenizer_path, spec = job
    key = f"{tokenizer_path}@{spec['tokenizer_fingerprint']}"
    tok = _worker_tokenizers.get(key)
    if tok is None:
        tok = load_tokenizer(tokenizer_path)
        if tok.fingerprint != spec["tokenizer_fingerprint"]:
            raise ValueError(
                f"tokenizer file {tokenizer_path!r} changed while preparing data; rerun"
            )
        _worker_tokenizers[key] = tok
    dtype = token_dtype(tok.vocab_size)
    final = os.path.join(out_dir, shard_name(spec["index"]))
    tmp = f"{final}.tmp.{os.getpid()}"
    tokens = documents = 0
    try:
        with open(tmp, "wb") as f:
            for entry in spec["inputs"]:
                for text in iter_documents(entry["path"], spec["text_key"]):
                    ids = np.asarray(tok.encode(text, bos=True, eos=True), dtype=dtype)
                    f.write(ids.tobytes())
                    tokens += len(ids)
                    documents += 1
    except BaseException:  # an unreadable input: leave no partial shard behind
        os.remove(tmp)
        raise
    os.replace(tmp, final)
    record = {**spec, "tokens": tokens, "documents": documents}
    write_json_atomic(os.path.join(out_dir, f"shard_{spec['index']:05d}.json"), record)
    return record


def _remove_shard_files(out_dir: str, keep: int) -> None:
    """Delete temp files of interrupted runs and ``shard_*`` files whose index is >= ``keep``."""
    for name in os.listdir(out_dir):
        stem = name.split(".", 1)[0]
        if not (stem.startswith("shard_") and stem[6:].isdigit()):
            continue
        if int(stem[6:]) >= keep or ".tmp." in name:
            os.remove(os.path.join(out_dir, name))


def prepare_data(
    inputs: Sequence[str],
    output_dir: str,
    tokenizer_path: str,
    *,
    text_key: str = "text",
    workers: int = 1,
    shard_size_mb: float = 64.0,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize ``inputs`` into shards under ``output_dir`` and return the metadata dict.

    Args:
        inputs: files or directories (walked recursively, sorted; hidden entries and files under
            ``output_dir`` skipped).
            ``.jsonl``/``.jsonl.gz``: one JSON object per line, text under ``text_key``;
            ``.parquet``: text column ``text_key``; anything else: one UTF-8 text document per
            file (undecodable bytes replaced).
        output_dir: created if missing.
        tokenizer_path: a Llama 3 format ``tokenizer.model`` or a Hugging Face ``tokenizer.json``
            (or its folder; see ``titanlab.data.tokenizer.load_tokenizer``).
        text_key: JSON field / Parquet column that holds the text.
        workers: parallel tokenizer processes (1 = tokenize in this process).
        shard_size_mb: target input megabytes (1e6 bytes) per shard.
        overwrite: start over when ``output_dir`` holds data of another tokenizer.
        progress: draw a tqdm bar over input bytes, when stderr is a terminal (none in logs).

    Returns:
        The content of ``metadata.json``.

    Raises:
        FileNotFoundError: an input or the tokenizer does not exist.
        ValueError: bad ``workers``/``shard_size_mb``, no input files, unreadable records, or
            ``output_dir`` prepared with another tokenizer and ``overwrite`` not set.
    """
    if workers < 1:
        raise ValueError(f"workers={workers} is invalid; use an integer >= 1")
    if shard_size_mb <= 0:
        raise ValueError(f"shard_size_mb={shard_size_mb} is invalid; use a positive number")
    tok = load_tokenizer(tokenizer_path)
    out_prefix = os.path.join(os.path.abspath(output_dir), "")
    files = [f for f in list_input_files(inputs) if not f.startswith(out_prefix)]
    if not files:
        raise ValueError(f"inputs {list(inputs)!r} hold no files outside the output dir")
    os.makedirs(output_dir, exist_ok=True)
    meta_path = os.path.join(output_dir, METADATA_FILE)
    old_meta = _read_json(meta_path)
    if old_meta is not None and old_meta.get("tokenizer_fingerprint") != tok.fingerprint:
        if not overwrite:
            raise ValueError(
                f"{output_dir!r} was prepared with tokenizer {old_meta.get('tokenizer_fingerprint')}"
                f" but {tokenizer_path!r} is {tok.fingerprint}; pass --overwrite or another --output"
            )
        _remove_shard_files(output_dir, keep=0)
    if os.path.exists(meta_path):
        os.remove(meta_path)  # the directory is incomplete until metadata.json is rewritten

    groups = group_into_shards(files, int(shard_size_mb * 1e6))
    _remove_shard_files(output_dir, keep=len(groups))
    specs = [_shard_spec(i, g, tok.fingerprint, text_key) for i, g in enumerate(groups)]
    itemsize = token_dtype(tok.vocab_size).itemsize
    records: dict[int, dict] = {}
    todo = []
    for spec in specs:
        if _is_done(output_dir, spec, itemsize):
            # _is_done just read and validated this record, so it is not None here
            records[spec["index"]] = cast(
                dict, _read_json(os.path.join(output_dir, f"shard_{spec['index']:05d}.json"))
            )
        else:
            todo.append((output_dir, tok.path, spec))

    total_bytes = sum(e["bytes"] for _, _, s in todo for e in s["inputs"])
    # disable=None: tqdm draws only where stderr is a terminal, not into captured logs
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not progress or None
    )
    bar.set_postfix(shards=f"{len(records)}/{len(specs)}")
    pool = None
    results: Iterator[dict]
    if workers > 1 and len(todo) > 1:
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(todo)))
        results = pool.imap_unordered(_tokenize_shard, todo)
    else:
        results = map(_tokenize_shard, todo)
    try:
        for record in results:
            records[record["index"]] = record
            bar.update(sum(e["bytes"] for e in record["inputs"]))
            bar.set_postfix(shards=f"{len(records)}/{len(specs)}")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()

    shards = [records[i] for i in range(len(specs))]
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": token_dtype(tok.vocab_size).name,
        "vocab_size": tok.vocab_size,
        "tokenizer_fingerprint": tok.fingerprint,
        "tokenizer_path": tok.path,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "text_key": text_key,
        "num_shards": len(shards),
        "total_tokens": sum(r["tokens"] for r in shards),
        "total_documents": sum(r["documents"] for r in shards),
        "shards": [
            {"file": shard_name(r["index"]), "tokens": r["tokens"], "documents": r["documents"]}
            for r in shards
        ],
    }
    write_json_atomic(meta_path, meta)
    return meta
