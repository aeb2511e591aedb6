"""GGUF export read back with the gguf package's reader: names, types, shapes, values, the RoPE
factors, the layouts llama.cpp expects, metadata and the embedded tokenizer; bad input is one
line. (llama.cpp itself runs the files in tests/integration/test_gguf_llama_cpp.py.)"""

import dataclasses
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlab.checkpoint.convert import ConversionError
from titanlab.checkpoint.gguf_export import dcp_to_gguf, gguf_tensor_name
from titanlab.checkpoint.gguf_vocab import CONTROL, NORMAL, gguf_vocab
from titanlab.checkpoint.hf_tokenizer import write_hf_tokenizer
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path, load_tokenizer
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.rope import rope_frequencies
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.models.stored_args import write_model_args

from convert_runs import convert_in_process

gguf = pytest.importorskip("gguf")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOK = Tokenizer(default_tokenizer_path())
LLAMA = dataclasses.replace(
    llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32,
    vocab_size=TOK.vocab_size, max_seq_len=32,
)  # fmt: skip
QWEN3 = dataclasses.replace(
    get_flavor(get_family("qwen3"), "debugmodel"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, hidden_dim=96, vocab_size=TOK.vocab_size, max_seq_len=32,
    tie_word_embeddings=True,
)  # fmt: skip


def save_dcp(path, family: str, args) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": sd, "train_state": {"step": 3}}, checkpoint_id=str(path), no_dist=True)
    write_model_args(str(path), get_family(family), args)
    return sd


def read(path) -> tuple[dict, dict]:
    """(name → (type name, shape in numpy order, fp32 values), metadata key → value)."""
    r = gguf.GGUFReader(str(path))
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        tensors[t.name] = (t.tensor_type.name, shape, torch.from_numpy(np.array(values)))
    meta = {k: f.contents() for k, f in r.fields.items()}
    return tensors, meta


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_llama_tensors_round_trip_in_each_dtype(tmp_path, dtype):
    sd = save_dcp(tmp_path / "dcp", "llama3", LLAMA)
    dcp_to_gguf(str(tmp_path / "dcp"), str(tmp_path / "m.gguf"), dtype=dtype, progress=False)
    tensors, meta = read(tmp_path / "m.gguf")
    assert set(tensors) == {gguf_tensor_name(n) for n in sd} | {"rope_freqs.weight"}
    tol = {"f32": 0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 0}[dtype]
    for name, want in sd.items():
        kind, shape, got = tensors[gguf_tensor_name(name)]
        assert shape == tuple(want.shape)
        if want.dim() == 1:
            assert kind == "F32" and torch.equal(got, want)  # norms stay exact
            continue
        assert kind == dtype.upper()
        if dtype == "q8_0":  # per block of 32, step d = max|x| / 127 stored in fp16:
            blocks = want.reshape(-1, 32)  # |error| <= d/2 + 127 * (d's fp16 rounding)
            amax = blocks.abs().amax(dim=1, keepdim=True)
            assert ((got.reshape(-1, 32) - blocks).abs() <= amax / 254 + amax * 2**-11).all()
        else:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # (wq/wk compared unpermuted above: llama.cpp's `llama` rotates interleaved pairs, as
    # titanlab does)
    plain = rope_frequencies(LLAMA.head_dim, LLAMA.rope_theta, None)
    scaled = rope_frequencies(LLAMA.head_dim, LLAMA.rope_theta, LLAMA.rope_scaling)
    torch.testing.assert_close(tensors["rope_freqs.weight"][2], plain / scaled)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert meta["llama.attention.head_count_kv"] == 2 and meta["llama.rope.dimension_count"] == 16
    assert meta["llama.feed_forward_length"] == LLAMA.ffn_hidden_dim()
    assert meta["general.file_type"] == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[dtype]


def test_qwen3_is_written_in_rotate_half_layout_and_tied(tmp_path):
    sd = save_dcp(tmp_path / "dcp", "qwen3", QWEN3)
    dcp_to_gguf(str(tmp_path / "dcp"), str(tmp_path / "q.gguf"), dtype="f32", progress=False)
    tensors, meta = read(tmp_path / "q.gguf")
    adapter = HFStateDictAdapter(QWEN3)
    for name in ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight"):
        want = adapter.to_hf(f"layers.1.{name}", sd[f"layers.1.{name}"])[1]
        assert torch.equal(tensors[gguf_tensor_name(f"layers.1.{name}")][2], want)
    assert "output.weight" not in tensors and "rope_freqs.weight" not in tensors
    assert meta["general.architecture"] == "qwen3" and meta["qwen3.attention.key_length"] == 16


def test_embedded_tokenizer_is_the_byte_level_vocab_with_specials(tmp_path):
    save_dcp(tmp_path / "dcp", "llama3", LLAMA)
    dcp_to_gguf(str(tmp_path / "dcp"), str(tmp_path / "m.gguf"), dtype="f16", progress=False)
    _, meta = read(tmp_path / "m.gguf")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == TOK.vocab_size == len(types)
    assert tokens[TOK.bos_id] == "<|begin_of_text|>" and tokens[TOK.eot_id] == "<|eot_id|>"
    assert types[: TOK.num_base_tokens] == [NORMAL] * TOK.num_base_tokens
    assert types[TOK.num_base_tokens :] == [CONTROL] * 256
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ"  # GPT-2's byte-to-unicode map
    assert meta["tokenizer.ggml.pre"] == "llama-bpe" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.bos_token_id"] == TOK.bos_id
    assert meta["tokenizer.ggml.eos_token_id"] == TOK.eos_id
    assert "<|start_header_id|>" in meta["tokenizer.chat_template"]
    assert len(meta["tokenizer.ggml.merges"]) > 3000


def test_tokenizer_json_vocab_equals_the_tiktoken_one(tmp_path):
    """The same vocabulary through the tokenizer.json path (Qwen3-style folders) as through
    the tiktoken one, with unused padding rows past the tokenizer."""
    write_hf_tokenizer(TOK, str(tmp_path))
    from_json = gguf_vocab(load_tokenizer(str(tmp_path)), TOK.vocab_size + 8)
    direct = gguf_vocab(TOK, TOK.vocab_size)
    assert from_json.tokens[: TOK.vocab_size] == direct.tokens
    assert from_json.tokens[-1] == f"[PAD{TOK.vocab_size + 7}]"
    assert from_json.token_types[: TOK.vocab_size] == direct.token_types
    assert from_json.merges == direct.merges and from_json.pre == "llama-bpe"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", "to-gguf", *map(str, args), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_bad_input_is_one_line(tmp_path, capsys):
    save_dcp(tmp_path / "dcp", "llama3", LLAMA)
    (tmp_path / "taken.gguf").write_bytes(b"x")
    moe = get_flavor(get_family("qwen3_moe"), "debugmodel")
    save_dcp(tmp_path / "moe", "qwen3_moe", dataclasses.replace(moe, vocab_size=TOK.vocab_size))
    cases = [
        ((tmp_path / "dcp", tmp_path / "o.gguf", "--dtype", "q4"), "invalid choice: 'q4'"),
        ((tmp_path / "dcp", tmp_path / "taken.gguf"), "exists; choose a new name or pass"),
        ((tmp_path / "nope", tmp_path / "o.gguf"), "nope"),
        ((tmp_path / "moe", tmp_path / "o.gguf"), "to-gguf supports the families llama3, qwen3"),
    ]
    for i, (args, message) in enumerate(cases):
        if i == 0:  # one case as a process, the rest in this one
            r = _cli(*args)
            code, err = r.returncode, r.stderr
        else:
            code, err = convert_in_process(capsys, "to-gguf", *map(str, args), "--quiet")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith("convert_checkpoint: error: ") and message in lines[0]
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "o.gguf.partial").exists()


def test_an_interrupted_export_leaves_no_file(tmp_path, monkeypatch):
    save_dcp(tmp_path / "dcp", "llama3", LLAMA)
    calls = {"n": 0}
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, tensor, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    with pytest.raises(OSError, match="disk full"):
        dcp_to_gguf(str(tmp_path / "dcp"), str(tmp_path / "m.gguf"), progress=False)
    assert os.listdir(tmp_path) == ["dcp"]


def test_without_a_tokenizer_it_refuses(tmp_path):
    save_dcp(tmp_path / "dcp", "llama3", dataclasses.replace(LLAMA, vocab_size=300))
    with pytest.raises(ConversionError, match="needs the model's tokenizer; pass --tokenizer"):
        dcp_to_gguf(str(tmp_path / "dcp"), str(tmp_path / "m.gguf"), progress=False)
