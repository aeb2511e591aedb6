"""The tokenizer of a GGUF file: llama.cpp's `gpt2` (byte-level BPE) vocabulary built from a
titanlab tokenizer.

GGUF keeps the tokenizer as metadata (llama.cpp `gguf` docs, "tokenizer.ggml.*" keys): the token
strings in id order (bytes shown through GPT-2's byte-to-unicode map), a type per token
(normal, control, user-defined, unused), the merges as "left right" strings in priority order,
the pre-tokenizer's name (which split regex llama.cpp applies), the BOS/EOS/EOT/padding ids and
the chat template.

- A Llama 3 format (tiktoken) tokenizer: merges recovered from the ranks (see
  `titanlab.checkpoint.hf_tokenizer`), its 256 special tokens as control tokens, pre-tokenizer
  `llama-bpe` (the Llama 3 split regex, with whole words looked up before merging as tiktoken
  does), the Llama 3 chat template.
- A Hugging Face tokenizer.json: its byte-level BPE model read as is; supported when its split
  regex is one llama.cpp names (Llama 3's: `llama-bpe`, Qwen2/Qwen3's: `qwen2`).

Ids the model's embedding has beyond the tokenizer's (Qwen3 pads 151,669 ids to 151,936) become
`[PAD{id}]` tokens of type unused, as llama.cpp's own converter writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from titanlab.checkpoint.hf_tokenizer import byte_level_vocab_and_merges
from titanlab.data.chat import LLAMA3_CHAT_TEMPLATE
from titanlab.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    AnyTokenizer,
    Tokenizer,
    _parse_bpe_file,
)

# llama.cpp token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {LLAMA3_SPLIT_PATTERN: "llama-bpe", QWEN2_SPLIT_PATTERN: "qwen2"}
"""Split regex → the name llama.cpp gives that pre-tokenizer (`tokenizer.ggml.pre`)."""


@dataclass
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of one tokenizer (see the module docstring)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int
    eot_id: int | None
    pad_id: int | None
    chat_template: str | None


def _pad(tokens: list[str], types: list[int], rows: int) -> None:
    for i in range(len(tokens), rows):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)


def _tiktoken_vocab(tok: Tokenizer, rows: int) -> GGUFVocab:
    with open(tok.path, "rb") as f:
        ranks = _parse_bpe_file(tok.path, f.read())
    vocab, merges = byte_level_vocab_and_merges(ranks)
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += list(LLAMA3_SPECIAL_TOKENS)
    types = [NORMAL] * len(ranks) + [CONTROL] * len(LLAMA3_SPECIAL_TOKENS)
    _pad(tokens, types, rows)
    return GGUFVocab(
        tokens=tokens,
        token_types=types,
        merges=[f"{a} {b}" for a, b in merges],
        pre="llama-bpe",
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        eot_id=tok.eot_id,
        pad_id=tok.pad_id,
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )


def _split_regex(pre_tokenizer: dict | None) -> str | None:
    """The first Split regex of a tokenizer.json pre-tokenizer (a Sequence or one Split)."""
    if not pre_tokenizer:
        return None
    parts = pre_tokenizer.get("pretokenizers") or [pre_tokenizer]
    for part in parts:
        if part.get("type") == "Split" and "Regex" in part.get("pattern", {}):
            return str(part["pattern"]["Regex"])
    return None


def _tokenizer_json_vocab(tok: AnyTokenizer, rows: int) -> GGUFVocab:
    with open(tok.path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(
            f"tokenizer {tok.path!r} is not a byte-level BPE; GGUF export supports byte-level "
            "BPE tokenizers (Llama 3, Qwen2/Qwen3) only"
        )
    regex = _split_regex(spec.get("pre_tokenizer"))
    if regex not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer {tok.path!r} splits text with a regex llama.cpp does not name "
            f"({regex!r}); supported: the Llama 3 and Qwen2/Qwen3 pre-tokenizers"
        )
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens", []):
        by_id[int(added["id"])] = (added["content"], CONTROL if added["special"] else USER_DEFINED)
    if max(by_id) >= rows:
        raise ValueError(
            f"tokenizer {tok.path!r} has id {max(by_id)} but the embedding only {rows} rows"
        )
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED))[0] for i in range(rows)]
    types = [by_id.get(i, ("", UNUSED))[1] for i in range(rows)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    eot = next((i for i, (t, _) in by_id.items() if t == "<|im_end|>"), None)  # ChatML
    return GGUFVocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        pre=PRE_TOKENIZERS[regex],
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        eot_id=eot,
        pad_id=getattr(tok, "pad_id", None),
        chat_template=getattr(tok, "chat_template", None),
    )


def gguf_vocab(tok: AnyTokenizer, rows: int) -> GGUFVocab:
    """The GGUF vocabulary of `tok` for a model whose embedding has `rows` rows.

    Raises:
        ValueError: one line — a tokenizer.json that is not byte-level BPE or whose split
            regex llama.cpp does not name, or ids beyond `rows`.
    """
    if isinstance(tok, Tokenizer):
        return _tiktoken_vocab(tok, rows)
    return _tokenizer_json_vocab(tok, rows)
