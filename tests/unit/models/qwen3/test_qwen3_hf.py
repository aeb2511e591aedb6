"""Qwen3 (and custom-shaped Llama) against transformers: import, logits, bitwise round trips.

A random `transformers` model is saved as a Hugging Face folder, imported with
`convert_checkpoint from-hf` (`hf_to_dcp`), and titanlab's model built from the imported args
must give the same logits on real text; DCP → HF → DCP and HF → DCP → HF must be bitwise.
"""

import dataclasses
import glob
import json
import os

import pytest
import torch
from safetensors import safe_open

from titanlab.checkpoint.convert import DcpModelReader, dcp_to_hf, hf_to_dcp
from titanlab.data.default_corpus import default_corpus_files
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.models.registry import build_model
from titanlab.models.stored_args import read_model_args

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers loads local folders only

TOKENIZER = Tokenizer(default_tokenizer_path())
VOCAB = TOKENIZER.vocab_size


def real_tokens(batch: int = 2, seq: int = 64) -> torch.Tensor:
    """(batch, seq) ids of Python standard-library source, the bundled tokenizer's corpus."""
    path = next(
        f for f in default_corpus_files() if f.endswith(os.sep + "json" + os.sep + "decoder.py")
    )
    with open(path, encoding="utf-8") as f:
        ids = TOKENIZER.encode(f.read(), bos=True, eos=False)
    return torch.tensor(ids[: batch * seq]).view(batch, seq)


def random_hf_model(config):
    """A transformers model with random weights, norm weights (q/k norms included) too: a
    norm weight left at ones would hide a wrong permutation."""
    torch.manual_seed(0)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def read_folder(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def import_and_check(hf_model, tmp_path) -> None:
    """Save, import, compare logits, and round-trip both ways bitwise."""
    hf_dir, dcp_dir = tmp_path / "hf", tmp_path / "dcp"
    hf_model.save_pretrained(str(hf_dir), safe_serialization=True)
    args = hf_to_dcp(str(hf_dir), str(dcp_dir), progress=False)
    stored = read_model_args(str(dcp_dir))
    assert stored is not None and stored[2] == args

    reader = DcpModelReader(str(dcp_dir))
    model = build_model(dataclasses.replace(args, max_seq_len=64)).eval()
    model.load_state_dict({k: reader.load(k) for k in model.state_dict()})
    tokens = real_tokens()
    with torch.no_grad():
        diff = (hf_model(tokens).logits - model(tokens)).abs().max().item()
    print(f"{type(hf_model).__name__}: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-4

    # HF → DCP → HF: the re-exported tensors equal the original files bit for bit.
    dcp_to_hf(str(dcp_dir), str(tmp_path / "hf2"), dtype=torch.float32, progress=False)
    want, got = read_folder(str(hf_dir)), read_folder(str(tmp_path / "hf2"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["architectures"] == hf_model.config.architectures
    # DCP → HF → DCP: the re-imported DCP equals the first import bit for bit.
    hf_to_dcp(str(tmp_path / "hf2"), str(tmp_path / "dcp2"), progress=False)
    back = DcpModelReader(str(tmp_path / "dcp2"))
    assert back.tensors.keys() == reader.tensors.keys()
    assert all(torch.equal(back.load(k), reader.load(k)) for k in reader.tensors)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_imports_with_transformers_logits_and_round_trips(tied, tmp_path):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=24,  # not hidden_size / heads, as in the published sizes
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=tied,
        architectures=["Qwen3ForCausalLM"],
    )
    import_and_check(random_hf_model(config), tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_shape_of_no_flavor_imports_and_round_trips(family, tmp_path):
    """9 heads, 3 KV heads, 30 layers, rms_norm_eps 1e-6: no built-in flavor has these."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=72,
        intermediate_size=120,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    else:
        config = transformers.Qwen3Config(**common, head_dim=16, architectures=["Qwen3ForCausalLM"])
    import_and_check(random_hf_model(config), tmp_path)
    stored = read_model_args(str(tmp_path / "dcp"))
    assert stored is not None and stored[1] == "hf"  # a custom shape, not a flavor


def test_a_config_field_qwen3_cannot_honour_is_one_line(tmp_path):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        architectures=["Qwen3ForCausalLM"],
    )
    random_hf_model(config).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ValueError) as e:
        hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)
    assert "attention_bias=True is not supported by titanlab's qwen3" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "dcp").exists()
