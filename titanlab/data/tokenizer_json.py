"""Hugging Face `tokenizer.json` tokenizers (Qwen3's, and any other) through the `tokenizers`
library, with the interface of titanlab's tiktoken `Tokenizer`.

The special tokens come from `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`; a
string or a `{"content": ...}` entry), else `special_tokens_map.json`, beside the file. Encoding
is what `transformers.AutoTokenizer` does without its own additions: the library's
normalizer, pre-tokenizer and BPE model, with added special tokens written in the text matched as
special ids; `bos` / `eos` then add the configured ids (a tokenizer without a BOS, like Qwen3's,
adds none).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
"""The files of a Hugging Face tokenizer folder, copied next to an exported model."""


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) and entry else None


class HFTokenizer:
    """A `tokenizer.json` tokenizer.

    Args:
        path: the `tokenizer.json` file, or the folder holding it.
    Raises:
        FileNotFoundError: no tokenizer.json there.
        ValueError: the file does not parse, or a configured special token is not in it.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer file {file!r} not found (expected tokenizer.json)")
        self.path = os.path.abspath(file)
        self.folder = os.path.dirname(self.path)
        with open(file, "rb") as f:
            data = f.read()
        try:
            self._tok = _Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the library raises its own Exception type
            raise ValueError(f"{file!r} is not a valid tokenizer.json: {e}") from None
        config = self._special_token_config()
        self._fingerprint = hashlib.sha256(
            data + json.dumps(config, sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        self._bos = self._id_of(config, "bos_token")
        eos = self._id_of(config, "eos_token")
        if eos is None:
            raise ValueError(
                f"{self.folder!r} names no eos_token (tokenizer_config.json or "
                "special_tokens_map.json); documents need an end-of-text id"
            )
        self._eos = eos
        self._pad = self._id_of(config, "pad_token")
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        """The Jinja chat template of tokenizer_config.json, or None."""

    def _special_token_config(self) -> dict[str, Any]:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            file = os.path.join(self.folder, name)
            if os.path.isfile(file):
                try:
                    with open(file, encoding="utf-8") as f:
                        return dict(json.load(f))
                except (json.JSONDecodeError, TypeError, ValueError) as e:
                    raise ValueError(f"{file!r} is not valid JSON: {e}") from None
        return {}

    def _id_of(self, config: dict[str, Any], key: str) -> int | None:
        text = _token_text(config.get(key))
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"{key} {text!r} of {self.folder!r} is not in tokenizer.json")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included); a model's
        embedding may have more rows (Qwen3 pads 151,669 ids to 151,936)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        """Id of the configured BOS token, or None (Qwen3 has none)."""
        return self._bos

    @property
    def eos_id(self) -> int:
        """Id of the configured EOS token (Qwen3 base: `<|endoftext|>`)."""
        return self._eos

    @property
    def pad_id(self) -> int:
        """Id of the configured pad token, else the EOS id."""
        return self._eos if self._pad is None else self._pad

    @property
    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of tokenizer.json and its special-token config."""
        return self._fingerprint

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `text` into ids in `[0, vocab_size)`; `bos` / `eos` add the configured ids
        (no BOS id exists for some tokenizers: then `bos` adds nothing).

        Raises:
            ValueError: `text` is not a str.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = [self._bos] if bos and self._bos is not None else []
        ids.extend(self._tok.encode(text, add_special_tokens=False).ids)
        if eos:
            ids.append(self._eos)
        return ids

    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is `text` (e.g. a special token), or None."""
        found = self._tok.token_to_id(text)
        return None if found is None else int(found)

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids into text (special tokens kept as text)."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))
