import base64
import hashlib

import pytest

from titanlab.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    Tokenizer,
    _split_long_runs,
    default_tokenizer_path,
)

SAMPLE = (
    "Grüße, 世界! naïve café — emoji 🎉🚀\n"
    "def f(x: int) -> int:\n    return x ** 2  # ünïcode\n\n\tclass A: pass\r\n"
)


def write_tiny_model(path, merges=(b"ab", b"abc", b"  ")):
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    lines += [base64.b64encode(t) + b" " + str(256 + i).encode() for i, t in enumerate(merges)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(default_tokenizer_path())


def test_bundled_round_trip(tok):
    ids = tok.encode(SAMPLE, bos=False, eos=False)
    assert tok.decode(ids) == SAMPLE
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert len(ids) < len(SAMPLE.encode())  # the BPE actually merges


def test_bundled_special_ids(tok):
    base = tok.num_base_tokens
    assert base == 4096 and tok.vocab_size == base + 256
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.pad_id) == (base, base + 1, base + 9, base + 4)
    ids = tok.encode("hi", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id


def test_specials_in_text_are_plain_text(tok):
    text = "<|begin_of_text|>x<|eot_id|><|reserved_special_token_7|>"
    ids = tok.encode(text, bos=False, eos=False)
    assert all(i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text


def test_llama31_special_token_order():
    # With Meta's 128000 base tokens these are ids 128000, 128001, 128009, 128255.
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert LLAMA3_SPECIAL_TOKENS.index("<|begin_of_text|>") == 0
    assert LLAMA3_SPECIAL_TOKENS.index("<|end_of_text|>") == 1
    assert LLAMA3_SPECIAL_TOKENS.index("<|finetune_right_pad_id|>") == 4
    assert LLAMA3_SPECIAL_TOKENS.index("<|eot_id|>") == 9
    assert LLAMA3_SPECIAL_TOKENS[11] == "<|reserved_special_token_2|>"
    assert LLAMA3_SPECIAL_TOKENS[-1] == "<|reserved_special_token_246|>"


def test_tiny_hand_written_model(tmp_path):
    path = write_tiny_model(tmp_path / "tokenizer.model")
    tok = Tokenizer(path)
    assert tok.vocab_size == 259 + 256 and tok.bos_id == 259
    assert tok.encode("abc", bos=False, eos=False) == [257]
    assert tok.encode("ab x", bos=True, eos=False) == [259, 256, ord(" "), ord("x")]
    assert (
        tok.fingerprint
        == hashlib.sha256((tmp_path / "tokenizer.model").read_bytes()).hexdigest()[:16]
    )
    assert tok.decode(tok.encode(SAMPLE, bos=False, eos=False)) == SAMPLE


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer(str(tmp_path / "nope.model"))


@pytest.mark.parametrize(
    "content, match",
    [
        (b"not-base64!! 0\n", "line 1"),
        (b"YQ== 0 extra\n", "line 1"),
        (b"YQ== 0\nYg== 5\n", "0..n-1"),
        (b"YQ== 0\nYg== 1\n", "single-byte"),
    ],
)
def test_invalid_file(tmp_path, content, match):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer(str(path))


def _meta_split(s, limit):
    """Straightforward reference of how Meta's tokenizer cuts long (non-)whitespace runs."""
    out, start, run, is_space = [], 0, 0, s[0].isspace() if s else False
    for i, ch in enumerate(s):
        if ch.isspace() != is_space:
            run, is_space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    out.append(s[start:])
    return out


def test_long_runs_are_cut_like_meta(tok):
    text = "x" * 60_001 + " " * 25_001 + "y z" + "\n" * 50_000 + "w" * 10
    pieces = list(_split_long_runs(text))
    assert pieces == _meta_split(text, 25_000)
    assert len(pieces) > 1
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text
