"""tools/convert_checkpoint.py against the real consumer, transformers' LlamaForCausalLM.

1. Train the debug model (GQA 8/4 heads, llama3 RoPE scaling) under FSDP on 2 ranks, convert its
   sharded DCP checkpoint to Hugging Face, and compare transformers' logits with titanlab's.
2. Build a random transformers Llama of the same shape, convert it from Hugging Face, compare the
   logits, check the round trips are bitwise, and start a training run from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import safe_open

from conftest import REPO, SHALLOW, TINY, read_metrics
from titanlab.checkpoint.convert import DcpModelReader
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.models.llama3 import Transformer, llama3_flavors

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # load local folders only, never the hub
transformers = pytest.importorskip("transformers")

TOKENIZER = Tokenizer(default_tokenizer_path())
# Long enough that RoPE's scaled (low and medium) frequencies turn by a visible angle.
SEQ = 512
TOL = 1e-4


def debug_args(max_seq_len: int = SEQ):
    """The debug flavor's shape as the tiny runs train it (`TINY`: its first blocks)."""
    return dataclasses.replace(
        llama3_flavors["debugmodel"],
        vocab_size=TOKENIZER.vocab_size,
        max_seq_len=max_seq_len,
        n_layers=int(SHALLOW[1]),
    )


def text_tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    """(batch, seq) int64 tokens of real text (this repository's sources)."""
    with open(os.path.join(REPO, "titanlab", "checkpoint", "manager.py"), encoding="utf-8") as f:
        ids = TOKENIZER.encode(f.read(), bos=True, eos=False)
    assert len(ids) >= batch * seq
    return torch.tensor(ids[: batch * seq]).view(batch, seq)


def convert(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", *args, "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr


def load_titanlab(dcp_dir: str) -> Transformer:
    """The debug model with the weights of the DCP checkpoint at `dcp_dir` (any layout)."""
    model = Transformer(debug_args())
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, checkpoint_id=dcp_dir, no_dist=True)
    model.load_state_dict(sd)
    return model.eval()


def load_hf(folder: str):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def max_logit_diff(ours: Transformer, hf, tokens: torch.Tensor) -> float:
    return (ours(tokens) - hf(tokens).logits).abs().max().item()


def hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_fsdp_checkpoint_to_hf_matches_transformers(train, tmp_path):
    dump = str(tmp_path / "run")
    train(
        2,
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
        "--checkpoint.last_save_in_hf",
        "true",
        dump=dump,
    ).check()
    step = os.path.join(dump, "checkpoint", "step-3")
    reader = DcpModelReader(step)
    assert max(len(t.chunks) for t in reader.tensors.values()) == 2  # sharded over the 2 ranks

    out = str(tmp_path / "hf")
    convert("to-hf", step, out, "--dtype", "fp32")
    ours, hf, tokens = load_titanlab(step), load_hf(out), text_tokens()
    diff = max_logit_diff(ours, hf, tokens)
    print(f"\nFSDP step-3 -> HF: max |logits diff| = {diff:.3g} over {tuple(tokens.shape)} tokens")
    assert diff < TOL

    # The trainer's own HF folder (checkpoint.last_save_in_hf) holds the same tensors.
    trainer_hf = os.path.join(dump, "checkpoint", "hf-step-3")
    mine, theirs = hf_tensors(out), hf_tensors(trainer_hf)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert os.path.isfile(os.path.join(trainer_hf, "tokenizer.json"))

    # The llama3 RoPE scaling matters at these positions: without it transformers disagrees.
    plain = str(tmp_path / "hf_no_scaling")
    shutil.copytree(out, plain)
    config = json.loads(open(os.path.join(plain, "config.json")).read())
    config["rope_scaling"] = None
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(config, f)
    wrong = max_logit_diff(ours, load_hf(plain), tokens)
    print(f"same weights without rope scaling: max |logits diff| = {wrong:.3g}")
    assert wrong > 5 * TOL


def random_hf_llama(folder: str):
    """A random transformers Llama of the debug flavor's shape, saved in 2 MB shards."""
    args = debug_args()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim(),
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        initializer_range=0.05,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="2MB")
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    return model


def test_hf_to_dcp_matches_round_trips_and_starts_a_run(train, tiny_dataset, tmp_path):
    hf_dir, dcp_dir = str(tmp_path / "hf"), str(tmp_path / "dcp")
    hf = random_hf_llama(hf_dir)
    convert("from-hf", hf_dir, dcp_dir)
    tokens = text_tokens()
    diff = max_logit_diff(load_titanlab(dcp_dir), hf, tokens)
    print(f"\nrandom transformers Llama -> DCP: max |logits diff| = {diff:.3g}")
    assert diff < TOL

    # DCP -> HF -> DCP is bitwise, and so is HF -> DCP -> HF.
    hf2, dcp2 = str(tmp_path / "hf2"), str(tmp_path / "dcp2")
    convert("to-hf", dcp_dir, hf2, "--dtype", "fp32")
    convert("from-hf", hf2, dcp2)
    a, b = DcpModelReader(dcp_dir), DcpModelReader(dcp2)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.load(k), b.load(k)) for k in a.tensors)
    original, again = hf_tensors(hf_dir), hf_tensors(hf2)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)

    # checkpoint.initial_load_path starts training from it: the step-1 loss is the HF model's
    # loss on the first batch.
    dump = str(tmp_path / "run")
    run = train(
        1,
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "true",
        "--checkpoint.initial_load_path",
        dcp_dir,
        "--checkpoint.export_at_end",
        "false",
        dump=dump,
    ).check()
    assert f"loaded {dcp_dir} (step 0, model only)" in run.stdout
    from titanlab.components import builders as components
    from titanlab.config.manager import build_config
    from titanlab.data.build import build_data, build_loader

    config = build_config(TINY + ["--data.dataset_path", tiny_dataset, "--job.dump_folder", dump])
    train_set = build_data(config, components.build_tokenizer(config)).train
    inputs, labels = next(iter(build_loader(train_set, config, 0, 1)))
    with torch.no_grad():
        logits = hf(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    got = read_metrics(dump)[1]
    print(f"step-1 loss {got:.6f}, transformers on the same batch {expected:.6f}")
    assert abs(got - expected) < TOL
