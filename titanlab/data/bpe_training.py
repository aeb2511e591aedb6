"""Train a byte-level BPE with Hugging Face ``tokenizers`` and write it in tiktoken/Llama 3 format.

The output file has rank ``b`` for the single byte ``b`` (ranks 0..255), then one rank per merge in
the order the trainer learned them, so it loads with :class:`titanlab.data.tokenizer.Tokenizer`.
Pre-tokenization is Llama 3's split regex followed by byte-level mapping (no extra regex).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Iterator, Sequence

from titanlab.data.tokenizer import LLAMA3_SPLIT_PATTERN


def byte_level_alphabet() -> dict[str, int]:
    """Map each char of the GPT-2 byte-level alphabet to the raw byte (0..255) it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted, in byte order,
    to the code points 256, 257, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


def read_text(path: str) -> str:
    """Read a file as UTF-8, replacing undecodable bytes with U+FFFD."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def merges_to_ranks(merges: Iterable[tuple[str, str]]) -> list[bytes]:
    """Turn byte-level merges (in learned order) into the token bytes of ranks 0, 1, 2, ...

    Ranks 0..255 are the single bytes; each merge adds its concatenation unless an earlier merge
    already produced the same bytes.

    Raises:
        ValueError: a merge contains a char outside the byte-level alphabet.
    """
    char_to_byte = byte_level_alphabet()
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    for left, right in merges:
        try:
            token = bytes(char_to_byte[c] for c in left + right)
        except KeyError as e:
            raise ValueError(
                f"merge {left!r} + {right!r} has a non byte-level char {e.args[0]!r}"
            ) from None
        if token not in seen:
            seen.add(token)
            ranks.append(token)
    return ranks


def write_bpe_file(ranks: Sequence[bytes], path: str) -> None:
    """Write ``base64(token) rank`` lines atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        for rank, token in enumerate(ranks):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    os.replace(tmp, path)


def _merges_from_hf_json(tokenizer_json: str) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer_json)["model"]["merges"]
    # tokenizers >= 0.20 stores [left, right] pairs; older versions store "left right" strings.
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def train_bpe(
    files: Sequence[str],
    output_path: str,
    *,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> int:
    """Train a byte-level BPE on ``files`` and write it to ``output_path`` (tiktoken format).

    Each file is one document, read as UTF-8 with undecodable bytes replaced. Output is
    deterministic for the same files, ``vocab_size`` and ``min_frequency``.

    Args:
        files: text files to train on.
        output_path: where to write the ``base64 rank`` file.
        vocab_size: base tokens wanted (256 bytes + merges; the Llama 3 specials come on top).
        min_frequency: a pair seen fewer times than this is never merged.
        show_progress: let ``tokenizers`` draw its progress bars.

    Returns:
        The number of base tokens written (less than ``vocab_size`` when the data runs out of
        pairs).

    Raises:
        ValueError: ``vocab_size`` below 256 or no files.
        FileNotFoundError: a file does not exist.
        ImportError: ``tokenizers`` is not installed.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size={vocab_size} is too small; need >= 256 (the single bytes)")
    if not files:
        raise ValueError("no training files given; pass at least one text file")
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"training file {path!r} not found")
    try:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError(
            "training a tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from None

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=show_progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def documents() -> Iterator[str]:
        for path in files:
            yield read_text(path)

    hf.train_from_iterator(documents(), trainer=trainer, length=len(files))
    ranks = merges_to_ranks(_merges_from_hf_json(hf.to_str()))
    write_bpe_file(ranks, output_path)
    return len(ranks)
