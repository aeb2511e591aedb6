"""Tokenizer files of an exported Hugging Face folder: a tokenizer.json tokenizer's own files, or
those built from a titanlab (Llama 3 format) tokenizer.model.

Always writes a copy of the file as `original/tokenizer.model` (where Meta's folders keep it, and
what `model.tokenizer_path` takes). When the `tokenizers` library is installed it also writes
`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`, so that
`transformers.AutoTokenizer` and vLLM load the same vocabulary: a byte-level BPE whose merges are
recovered from the tiktoken ranks (a token of rank r is the merge of any two shorter tokens that
concatenate to it, at priority r), Llama 3's split regex, the 256 special tokens after the base
ranks, and `<|begin_of_text|>` prepended like Meta's Llama 3 tokenizer.json does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from titanlab.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    AnyTokenizer,
    Tokenizer,
    _parse_bpe_file,
    default_tokenizer_path,
    load_tokenizer,
)
from titanlab.data.tokenizer_json import TOKENIZER_FILES, HFTokenizer

logger = logging.getLogger(__name__)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters: printable Latin-1
    bytes map to themselves, the others to code points 256, 257, ... in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_vocab_and_merges(
    ranks: dict[bytes, int],
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab (string → id) and BPE merges ordered by the rank of their result."""
    to_str = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_str[b] for b in token)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return vocab, [(a, b) for *_, a, b in merges]


def _build_tokenizer_json(tok: Tokenizer) -> str:
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    with open(tok.path, "rb") as f:
        ranks = _parse_bpe_file(tok.path, f.read())
    vocab, merges = byte_level_vocab_and_merges(ranks)
    hf = HFTokenizer(
        models.BPE(vocab, merges, ignore_merges=True)
    )  # whole words first, as tiktoken
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL_TOKENS]
    )
    bos = "<|begin_of_text|>"
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.bos_id)],
    )
    assert hf.token_to_id(bos) == tok.bos_id and hf.get_vocab_size() == tok.vocab_size
    return hf.to_str(pretty=False)


def resolve_tokenizer(tokenizer_path: str | None, vocab_size: int) -> AnyTokenizer | None:
    """The tokenizer whose files go with a model of `vocab_size`, or None.

    Args:
        tokenizer_path: a Llama 3 format tokenizer.model or a Hugging Face tokenizer.json (or
            its folder); None: the bundled one if its vocab size is `vocab_size`, else none;
            "": none.
        vocab_size: the model's vocabulary (embedding rows).
    Raises:
        ValueError: `tokenizer_path` is unreadable, or its ids do not fit the embedding (a
            tiktoken tokenizer must have exactly `vocab_size` ids; a tokenizer.json at most).
    """
    if tokenizer_path == "":
        return None
    if tokenizer_path is None:
        tok = Tokenizer(default_tokenizer_path())
        if tok.vocab_size == vocab_size:
            return tok
        logger.warning(
            "convert: vocab size %d is not the bundled tokenizer's; no tokenizer "
            "files written (pass --tokenizer PATH/tokenizer.model)",
            vocab_size,
        )
        return None
    try:
        found = load_tokenizer(tokenizer_path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--tokenizer {tokenizer_path!r}: {e}") from None
    fits = (
        found.vocab_size <= vocab_size
        if isinstance(found, HFTokenizer)
        else found.vocab_size == vocab_size
    )
    if not fits:
        raise ValueError(
            f"--tokenizer {tokenizer_path!r} has {found.vocab_size} tokens but the "
            f"model's embedding has {vocab_size} rows"
        )
    return found


def write_hf_tokenizer(tok: AnyTokenizer, out_dir: str) -> None:
    """Write the tokenizer files of `tok` into `out_dir`: a Hugging Face tokenizer's own files
    (copied), or for a tiktoken one `original/tokenizer.model` and, with `tokenizers`
    installed, `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`."""
    if isinstance(tok, HFTokenizer):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tok.folder, name)):
                shutil.copyfile(os.path.join(tok.folder, name), os.path.join(out_dir, name))
        return
    os.makedirs(os.path.join(out_dir, "original"), exist_ok=True)
    shutil.copyfile(tok.path, os.path.join(out_dir, "original", "tokenizer.model"))
    try:
        tokenizer_json = _build_tokenizer_json(tok)
    except ImportError:
        logger.warning(
            "convert: `tokenizers` is not installed; wrote original/tokenizer.model "
            "only (pip install tokenizers for tokenizer.json)"
        )
        return
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    for name, obj in (
        ("special_tokens_map.json", special),
        (
            "tokenizer_config.json",
            {
                **special,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "clean_up_tokenization_spaces": False,
                "model_input_names": ["input_ids", "attention_mask"],
            },
        ),
    ):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
