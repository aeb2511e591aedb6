"""The streamed converter in-process: shards and index, tied weights, tokenizer, errors, CLI."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from titanlab.checkpoint.convert import (
    ConversionError,
    DcpModelReader,
    dcp_to_hf,
    hf_to_dcp,
    parse_size,
)
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.models.llama3 import Transformer, llama3_flavors

from convert_runs import convert_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VOCAB = Tokenizer(default_tokenizer_path()).vocab_size
DEBUG = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=VOCAB, max_seq_len=32)
TIED = dataclasses.replace(
    DEBUG, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_word_embeddings=True
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers loads local folders only


def save_dcp(path, args, seed=0) -> dict:
    """A model-only DCP checkpoint of a freshly initialized model; returns its state dict."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": sd, "train_state": {"step": 7}}, checkpoint_id=str(path), no_dist=True)
    return sd


def read_hf(folder) -> dict:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 5 * 10**8 and parse_size("123") == 123
    with pytest.raises(ConversionError, match="'-1' is not a positive size"):
        parse_size("-1")
    with pytest.raises(ConversionError, match="'lots' is not a positive size"):
        parse_size("lots")


def test_to_hf_shards_index_and_config(tmp_path):
    sd = save_dcp(tmp_path / "dcp", DEBUG)
    dcp_to_hf(
        str(tmp_path / "dcp"),
        str(tmp_path / "hf"),
        dtype=torch.float32,
        max_shard_bytes=3 * 10**6,
        progress=False,
    )
    files = sorted(os.listdir(tmp_path / "hf"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    expected = HFStateDictAdapter(DEBUG).to_hf_state_dict(sd)
    assert set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    for shard in shards:  # every shard within the limit unless it holds one tensor
        size = os.path.getsize(tmp_path / "hf" / shard)
        with safe_open(str(tmp_path / "hf" / shard), framework="pt") as f:
            assert size < 3 * 10**6 + 10**4 or len(list(f.keys())) == 1
            assert f.metadata() == {"format": "pt"}
    got = read_hf(tmp_path / "hf")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] == 4 and config["rope_scaling"]["rope_type"] == "llama3"
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": VOCAB - 256, "eos_token_id": VOCAB - 255}
    assert {"tokenizer.json", "tokenizer_config.json", "original"} <= set(files)


def test_to_hf_dtype_cast(tmp_path):
    sd = save_dcp(tmp_path / "dcp", DEBUG)
    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), dtype=torch.bfloat16, progress=False)
    got = read_hf(tmp_path / "hf")
    expected = HFStateDictAdapter(DEBUG).to_hf_state_dict(sd)
    assert all(
        got[k].dtype == torch.bfloat16 and torch.equal(got[k], expected[k].bfloat16())
        for k in expected
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tied_model_round_trip_and_transformers_logits(tmp_path):
    sd = save_dcp(tmp_path / "dcp", TIED)
    dcp_to_hf(
        str(tmp_path / "dcp"),
        str(tmp_path / "hf"),
        model_args=TIED,
        dtype=torch.float32,
        progress=False,
    )
    got = read_hf(tmp_path / "hf")
    assert "lm_head.weight" not in got and "model.embed_tokens.weight" in got
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp2"), model_args=TIED, progress=False)
    back = DcpModelReader(str(tmp_path / "dcp2"))
    assert set(back.tensors) == set(sd)  # output.weight written too, as save_model_only does
    assert all(torch.equal(back.load(k), sd[k]) for k in sd)

    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    model = Transformer(TIED)
    model.load_state_dict(sd)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    print(f"tied model: max |logits diff| = {diff:.3g}")
    assert diff < 1e-4


def test_hf_tokenizer_encodes_like_titanlab(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    save_dcp(tmp_path / "dcp", TIED)
    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), model_args=TIED, progress=False)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = Tokenizer(str(tmp_path / "hf" / "original" / "tokenizer.model"))
    with open(os.path.join(REPO, "titanlab", "checkpoint", "manager.py"), encoding="utf-8") as f:
        source = f.read()
    for text in [
        "Hello world!",
        "  x = 12345  # é 中文 \U0001f600\n\n\t  ",
        "it's  DON'T\r\n",
        source,
    ]:
        assert hf_tok(text)["input_ids"] == ours.encode(text, bos=True, eos=False)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_to_hf_errors_name_the_problem(tmp_path):
    save_dcp(tmp_path / "dcp", DEBUG)
    with pytest.raises(ConversionError, match="is not a folder"):
        dcp_to_hf(str(tmp_path / "missing"), str(tmp_path / "hf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="is not a DCP checkpoint: it is empty"):
        dcp_to_hf(str(tmp_path / "empty"), str(tmp_path / "hf"))
    with pytest.raises(
        ConversionError,
        match=r"DCP tensor model.tok_embeddings.weight has shape "
        r"\[4352, 256\] but flavor '1B' expects \[4352, 2048\]",
    ):
        dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), flavor="1B")
    with pytest.raises(
        ConversionError, match="flavor='9B' is unknown for model.name='llama3'; valid: debugmodel"
    ):
        dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), flavor="9B")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "full"))
    assert not (tmp_path / "hf").exists()  # nothing written on a bad input


def test_from_hf_errors_name_the_tensor(tmp_path):
    save_dcp(tmp_path / "dcp", DEBUG)
    hf = tmp_path / "hf"
    dcp_to_hf(str(tmp_path / "dcp"), str(hf), dtype=torch.float32, progress=False)
    with pytest.raises(ConversionError, match="has no config.json"):
        hf_to_dcp(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(ConversionError, match="'.*nope' does not exist"):  # not "no config.json"
        hf_to_dcp(str(tmp_path / "nope"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="does not match flavor '8B': hidden_size=256"):
        hf_to_dcp(str(hf), str(tmp_path / "out"), flavor="8B")
    # A tensor of the wrong shape under a config that matches: named with both shapes.
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    from safetensors.torch import save_file

    shard = hf / index["weight_map"]["model.layers.2.self_attn.k_proj.weight"]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(256, 256)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        ConversionError,
        match=r"HF tensor model.layers.2.self_attn.k_proj.weight has "
        r"shape \[256, 256\] but flavor 'debugmodel' expects \[128, 256\]",
    ):
        hf_to_dcp(str(hf), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def cli(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    entry = (
        [os.path.join(REPO, "tools", "convert_checkpoint.py")]
        if script
        else ["-m", "tools.convert_checkpoint"]
    )
    return subprocess.run(
        [sys.executable, *entry, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_cli_round_trip_and_one_line_errors(tmp_path, capsys):
    sd = save_dcp(tmp_path / "dcp", DEBUG)
    ok = cli("to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--dtype", "fp32", "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("convert_checkpoint: to-hf: wrote")
    ok = cli("from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp2"), "--quiet", script=True)
    assert ok.returncode == 0, ok.stderr
    back = DcpModelReader(str(tmp_path / "dcp2"))
    assert all(torch.equal(back.load(k), sd[k]) for k in sd)

    for args, message in [
        (("to-hf", str(tmp_path / "nope"), str(tmp_path / "o")), "is not a folder"),
        (("to-hf", str(tmp_path / "dcp"), str(tmp_path / "o"), "--flavor", "3B"), "expects"),
        (("from-hf", str(tmp_path / "dcp"), str(tmp_path / "o")), "has no config.json"),
        (("from-hf", str(tmp_path / "hf")), "the following arguments are required: dcp_dir"),
        (("to-hf", "a", "b", "--dtype", "int8"), "argument --dtype: invalid choice: 'int8'"),
        (
            ("to-hf", str(tmp_path / "dcp"), str(tmp_path / "o"), "--max-shard-size", "big"),
            "'big' is not a positive size",
        ),
        (
            (
                "to-hf",
                str(tmp_path / "dcp"),
                str(tmp_path / "o"),
                "--tokenizer",
                str(tmp_path / "t"),
            ),
            "not found",
        ),
    ]:
        if message == "is not a folder":  # one case as a process, the rest in this one
            proc = cli(*args)
            code, err = proc.returncode, proc.stderr
        else:
            code, err = convert_in_process(capsys, *args)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convert_checkpoint: error: "), err
        assert message in lines[0]
