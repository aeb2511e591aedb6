"""Hugging Face tokenizer.json tokenizers (`titanlab.data.tokenizer_json`) against
`transformers.AutoTokenizer`, on a Qwen-style tokenizer built here with `tokenizers` (no hub)."""

import json
import os

import pytest

from titanlab.data.default_corpus import default_corpus_files
from titanlab.data.prepare import prepare_data
from titanlab.data.tokenizer import load_tokenizer
from titanlab.data.tokenizer_json import HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

# Qwen2/Qwen3's pre-tokenizer split: like Llama 3's, but digits one at a time.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus_text(min_bytes: int) -> str:
    """At least `min_bytes` of Python standard-library source, plus chat-formatted and
    non-ASCII text with the special tokens written in it."""
    parts, size = [], 0
    for path in default_corpus_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        parts.append(text)
        size += len(text.encode())
        if size >= min_bytes:
            break
    parts.append(
        "<|im_start|>user\nWie viel kostet 1234,56 €? Überprüfe 東京 и Москва.<|im_end|>\n"
        "<|im_start|>assistant\nDone: naïve café — 42 ✓<|im_end|><|endoftext|>"
    )
    return "\n".join(parts)


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory) -> str:
    """A folder with a byte-level BPE tokenizer.json (NFC, Qwen's split, 3 specials) trained
    on the stdlib, and a tokenizer_config.json like Qwen3 base's (eos <|endoftext|>, no bos)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("qwen_tok")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text(400_000)], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    return str(folder)


def test_ids_equal_autotokenizer_on_50kb_of_real_text(qwen_style):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(qwen_style)
    ours = load_tokenizer(os.path.join(qwen_style, "tokenizer.json"))
    assert isinstance(ours, HFTokenizer)
    text = corpus_text(50_000)
    assert len(text.encode()) >= 50_000
    want = theirs(text)["input_ids"]
    got = ours.encode(text, bos=True, eos=False)  # no BOS configured: none added, like HF
    print(f"{len(text.encode())} bytes of text, {len(got)} ids, equal to AutoTokenizer's")
    assert got == want and len(got) > 10_000
    assert got.count(ours.eos_id) == 1 and theirs.convert_tokens_to_ids("<|im_end|>") in got
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        None,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.vocab_size == len(theirs)
    assert ours.decode(got) == theirs.decode(want)
    assert ours.encode("x", bos=False, eos=True)[-1] == theirs.eos_token_id


def test_the_folder_works_as_a_path_and_prepare_data_uses_it(qwen_style, tmp_path):
    ours = load_tokenizer(qwen_style)
    files = [f for f in default_corpus_files() if os.sep + "json" + os.sep in f][:3]
    meta = prepare_data(files, str(tmp_path / "data"), qwen_style, workers=1, progress=False)
    assert meta["vocab_size"] == ours.vocab_size and meta["eos_id"] == ours.eos_id
    assert meta["tokenizer_fingerprint"] == ours.fingerprint


def test_a_tokenizer_without_eos_is_one_line(qwen_style, tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        open(os.path.join(qwen_style, "tokenizer.json")).read()
    )
    with pytest.raises(ValueError, match="names no eos_token"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(ValueError, match="eos_token '<|nope|>' .* is not in tokenizer.json"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
