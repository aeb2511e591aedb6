"""Llama 3 style tiktoken tokenizer, and `load_tokenizer` (tiktoken or Hugging Face tokenizer.json).

Reads a BPE file in the Llama 3 ``tokenizer.model`` format (one ``base64(token bytes) rank`` per
line, ranks ``0..n-1``), splits text with Llama 3's pre-tokenizer regex and appends Llama 3.1's 256
special tokens after the base vocabulary. With Meta's 128000-token file the ids match Meta's
(``<|begin_of_text|>`` = 128000, ``<|end_of_text|>`` = 128001, ``<|eot_id|>`` = 128009).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Iterator, Sequence

import tiktoken

from titanlab.data.tokenizer_json import HFTokenizer

# Llama 3's pre-tokenizer split pattern (identical to OpenAI's cl100k pattern).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
# Llama 3.1 order: the named tokens, then reserved tokens numbered from 2 up to 256 in total.
LLAMA3_SPECIAL_TOKENS = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)

# tiktoken panics on very long inputs and is quadratic on very long runs of (non-)whitespace, so
# text is encoded in pieces exactly as Meta's reference tokenizer cuts it.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_LONG_RUN_RE = re.compile(rf"(?<!\s)\s{{{_MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{_MAX_RUN_CHARS + 1},}}")

_ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def default_tokenizer_path() -> str:
    """Path of the bundled 4096-token BPE trained on the Python standard library."""
    return os.path.join(_ASSETS_DIR, "stdlib_bpe_4k.model")


def _parse_bpe_file(path: str, data: bytes) -> dict[bytes, int]:
    """Parse ``base64 rank`` lines into a rank table; ValueError on any malformed content."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ValueError(
                f"tokenizer file {path!r} line {lineno} is not 'base64(token) rank': {line[:60]!r}"
            ) from None
        if token in ranks:
            raise ValueError(f"tokenizer file {path!r} line {lineno} repeats token {token!r}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tokenizer file {path!r} ranks must be exactly 0..n-1 with no gaps")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"tokenizer file {path!r} lacks single-byte tokens (e.g. byte {missing[0]}); "
            "all 256 bytes need a rank"
        )
    return ranks


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut runs of whitespace or non-whitespace longer than 25k chars every 25k chars."""
    cuts = [
        cut
        for m in _LONG_RUN_RE.finditer(text)
        for cut in range(m.start() + _MAX_RUN_CHARS, m.end(), _MAX_RUN_CHARS)
    ]
    start = 0
    for cut in cuts:
        yield text[start:cut]
        start = cut
    yield text[start:]


class Tokenizer:
    """Byte-level BPE tokenizer over ``tiktoken.Encoding`` with Llama 3's specials.

    Args:
        path: a Llama 3 format ``tokenizer.model`` file (``base64(token bytes) rank`` per line).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is malformed (bad line, ranks not ``0..n-1``, a byte without rank).
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer file {path!r} not found (expected a tokenizer.model)"
            )
        self.path = os.path.abspath(path)
        with open(path, "rb") as f:
            data = f.read()
        # Parsed here rather than with tiktoken.load.load_tiktoken_bpe: that caches by path under
        # the temp dir and would return stale ranks after the file at the same path changes.
        mergeable_ranks = _parse_bpe_file(path, data)
        self._fingerprint = hashlib.sha256(data).hexdigest()[:16]
        self._num_base = len(mergeable_ranks)
        self.special_tokens = {
            name: self._num_base + i for i, name in enumerate(LLAMA3_SPECIAL_TOKENS)
        }
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=LLAMA3_SPLIT_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        """Base BPE tokens plus the 256 special tokens."""
        return self._num_base + NUM_SPECIAL_TOKENS

    @property
    def num_base_tokens(self) -> int:
        """Number of ranks in the BPE file (ids of ordinary tokens are ``0..num_base_tokens-1``)."""
        return self._num_base

    @property
    def bos_id(self) -> int:
        """Id of ``<|begin_of_text|>`` (= number of base tokens)."""
        return self.special_tokens["<|begin_of_text|>"]

    @property
    def eos_id(self) -> int:
        """Id of ``<|end_of_text|>``."""
        return self.special_tokens["<|end_of_text|>"]

    @property
    def eot_id(self) -> int:
        """Id of ``<|eot_id|>`` (end of turn)."""
        return self.special_tokens["<|eot_id|>"]

    @property
    def pad_id(self) -> int:
        """Id of ``<|finetune_right_pad_id|>``, Llama 3.1's padding token."""
        return self.special_tokens["<|finetune_right_pad_id|>"]

    @property
    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of the tokenizer file's bytes."""
        return self._fingerprint

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode ``text`` into token ids in ``[0, vocab_size)``.

        Special-token strings inside ``text`` are encoded as ordinary text, never as special ids.
        Long texts are encoded in pieces of at most 400k chars and 25k-char runs, like Meta's.

        Args:
            text: the string to encode.
            bos: prepend ``bos_id``.
            eos: append ``eos_id``.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids: list[int] = [self.bos_id] if bos else []
        for i in range(0, len(text), _MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[i : i + _MAX_ENCODE_CHARS]):
                ids.extend(self._encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Decode token ids into text; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._encoding.decode([int(i) for i in ids])


def is_tokenizer_json(path: str) -> bool:
    """Whether `path` names a Hugging Face tokenizer: a `*.json` file or a folder holding a
    `tokenizer.json` (otherwise it is a tiktoken `tokenizer.model`)."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "tokenizer.json"))
    return path.endswith(".json")


AnyTokenizer = Tokenizer | HFTokenizer
"""Either kind of tokenizer: both have path, vocab_size, bos_id, eos_id, fingerprint, encode,
decode."""


_LOADED: dict[tuple[str, int, int], AnyTokenizer] = {}


def load_tokenizer(path: str) -> AnyTokenizer:
    """The tokenizer at `path`: a Hugging Face `tokenizer.json` (or its folder) through the
    `tokenizers` library, else a tiktoken `tokenizer.model` (Llama 3 format). A file loaded
    before (same path, size and modification time) gives the same object: parsing a 128k BPE
    file takes ~20 ms, and the pre-flight and the trainer each ask for it.

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: a malformed file.
    """
    try:
        st = os.stat(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None  # the constructors raise the one-line error
    if key is not None and key in _LOADED:
        return _LOADED[key]
    tokenizer: AnyTokenizer = HFTokenizer(path) if is_tokenizer_json(path) else Tokenizer(path)
    if key is not None:
        _LOADED[key] = tokenizer
    return tokenizer
