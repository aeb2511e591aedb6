"""Find input files and read documents out of them (plain text, JSONL, JSONL.gz, Parquet)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence


def list_input_files(inputs: Sequence[str]) -> list[str]:
    """Expand files and directories into a sorted list of file paths (absolute).

    Directories are walked recursively; names starting with ``.`` are skipped there.

    Raises:
        FileNotFoundError: an input path does not exist.
        ValueError: no files were found.
    """
    files: set[str] = set()
    for path in inputs:
        if os.path.isfile(path):
            files.add(os.path.abspath(path))
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                files.update(
                    os.path.abspath(os.path.join(root, n)) for n in names if not n.startswith(".")
                )
        else:
            raise FileNotFoundError(f"input {path!r} does not exist (expected a file or directory)")
    if not files:
        raise ValueError(
            f"no input files found under {list(inputs)!r}; pass text/jsonl/parquet files"
        )
    return sorted(files)


def input_kind(path: str) -> str:
    """``"jsonl"`` for ``.jsonl``/``.jsonl.gz``, ``"parquet"`` for ``.parquet``, else ``"text"``."""
    name = path.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _check_text(value: object, where: str, text_key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {text_key!r} is {type(value).__name__}, expected a string"
        )
    return value


def _iter_jsonl(path: str, text_key: str) -> Iterator[str]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{lineno} is not valid JSON") from None
            if not isinstance(record, dict) or text_key not in record:
                raise ValueError(
                    f"{path}:{lineno} has no field {text_key!r}; set --text-key to the text field"
                )
            yield _check_text(record[text_key], f"{path}:{lineno}", text_key)


def _iter_parquet(path: str, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path!r} needs the 'pyarrow' package: pip install 'titanlab[tools]'"
        ) from None
    pf = pq.ParquetFile(path)
    columns = pf.schema_arrow.names
    if text_key not in columns:
        raise ValueError(f"{path} has no column {text_key!r}; columns are {columns}")
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield _check_text(value, path, text_key)


def iter_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """Yield the non-empty text documents of one input file.

    A plain text file is one document, decoded as UTF-8 with undecodable bytes replaced by
    U+FFFD. JSONL yields ``record[text_key]`` per non-blank line; Parquet yields the non-null
    values of column ``text_key``.

    Raises:
        ValueError: a JSONL line is not JSON or lacks ``text_key``, the Parquet column is missing,
            or a text value is not a string.
        ImportError: a Parquet file is read without ``pyarrow`` installed.
    """
    kind = input_kind(path)
    if kind == "jsonl":
        docs: Iterator[str] = _iter_jsonl(path, text_key)
    elif kind == "parquet":
        docs = _iter_parquet(path, text_key)
    else:
        with open(path, "rb") as f:
            docs = iter([f.read().decode("utf-8", errors="replace")])
    for text in docs:
        if text:
            yield text
