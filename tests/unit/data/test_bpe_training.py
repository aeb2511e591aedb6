import base64

import pytest

from titanlab.data.bpe_training import byte_level_alphabet, merges_to_ranks, train_bpe
from titanlab.data.tokenizer import Tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n\n" * 20,
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語\n" * 20,
    "for i in range(10):\n    print(i, i * i)\n" * 20,
]


@pytest.fixture
def files(tmp_path):
    paths = []
    for i, text in enumerate(TEXTS):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    return paths


def test_byte_level_alphabet_is_a_bijection():
    alphabet = byte_level_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet.values()) == list(range(256))
    assert alphabet["a"] == ord("a") and alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n")


def test_merges_to_ranks_skips_repeated_tokens():
    ranks = merges_to_ranks([("a", "b"), ("ab", "c"), ("a", "bc"), ("Ġ", "Ġ")])
    assert ranks[:256] == [bytes([b]) for b in range(256)]
    assert ranks[256:] == [b"ab", b"abc", b"  "]


def test_train_writes_valid_deterministic_model(files, tmp_path):
    out = tmp_path / "bpe.model"
    n = train_bpe(files, str(out), vocab_size=300)
    assert 256 < n <= 300
    tok = Tokenizer(str(out))
    assert tok.num_base_tokens == n and tok.vocab_size == n + 256
    ranks = {}
    for line in out.read_bytes().splitlines():
        token, rank = line.split()
        ranks[int(rank)] = token
    assert [base64.b64decode(ranks[r]) for r in range(256)] == [bytes([b]) for b in range(256)]
    for text in TEXTS + ["unseen text ✓ with ñ and 🎉"]:
        ids = tok.encode(text, bos=False, eos=False)
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[0], bos=False, eos=False)) < 0.6 * len(TEXTS[0])  # merges apply

    again = tmp_path / "bpe2.model"
    train_bpe(files, str(again), vocab_size=300)
    assert again.read_bytes() == out.read_bytes()


def test_train_bad_args(files, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(files, str(tmp_path / "x.model"), vocab_size=100)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_bpe([str(tmp_path / "missing.txt")], str(tmp_path / "x.model"))
