"""The trained debug model, exported, behaves the same elsewhere: transformers' `generate` on its
Hugging Face export and llama.cpp on its GGUF files give titanlab's greedy tokens, perplexity and
token ids.

The llama.cpp tests need `llama-cpp-python`, which builds llama.cpp from source (minutes), so they
are opt-in: TITANLAB_LLAMA_CPP_TESTS=1 (`.ci/run` sets it and installs the package); with the
variable set, a missing package is a failure, not a skip.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY, launch
from titanlab.data.chat import LLAMA3_CHAT_TEMPLATE, render_chat
from titanlab.data.default_corpus import default_corpus_files
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.generation import generate
from titanlab.generation.loading import load_model
from tools.lib.runs import REPO

ENABLE = "TITANLAB_LLAMA_CPP_TESTS"
needs_llama_cpp = pytest.mark.skipif(
    os.environ.get(ENABLE) != "1",
    reason=f"opt-in: {ENABLE}=1 and llama-cpp-python installed (.ci/run does both)",
)
TOK = Tokenizer(default_tokenizer_path())
STEPS = 60
PROMPTS = [
    "import os\n",
    "def main(argv):\n    parser = argparse.ArgumentParser(",
    "class Reader:\n    def __init__(self, path):\n        self.path = path\n        self.",
    "    for key, value in sorted(items.items()):\n        if value is None:\n            ",
]


def convert(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", *args, "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """The debug model's first 2 blocks (`TINY`; dim 256, bundled 4k tokenizer) trained for 60
    steps of 8 × 128 tokens of the stdlib corpus in one process: its step-60 DCP checkpoint."""
    dump = str(tmp_path_factory.mktemp("trained"))
    overrides = ["--training.seq_len", "128", "--training.local_batch_size", "8",
                 "--training.steps", str(STEPS), "--checkpoint.interval", str(STEPS),
                 "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "20",
                 "--job.dump_folder", dump]  # fmt: skip
    launch(1, [*TINY, *overrides]).check()
    return os.path.join(dump, "checkpoint", f"step-{STEPS}")


@pytest.fixture(scope="module")
def model(trained):
    return load_model(trained, torch.device("cpu"), torch.float32)[0]


def prompt_ids() -> list[list[int]]:
    ids = [TOK.encode(p, bos=True, eos=False) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # four different lengths
    return ids


def held_out_windows(n: int = 4, length: int = 128) -> list[list[int]]:
    """Windows of titanlab's own source: Python the model never saw (it trains on the stdlib)."""
    with open(os.path.join(REPO, "titanlab", "checkpoint", "manager.py"), encoding="utf-8") as f:
        ids = TOK.encode(f.read(), bos=False, eos=False)
    return [[TOK.bos_id, *ids[i * length : (i + 1) * length - 1]] for i in range(n)]


def titanlab_perplexity(model, windows) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w]))[0]
            nll += torch.nn.functional.cross_entropy(
                logits[:-1], torch.tensor(w[1:]), reduction="sum"
            ).item()
            count += len(w) - 1
    return math.exp(nll / count)


def test_greedy_equals_transformers_generate_on_the_hf_export(trained, model, tmp_path):
    """Done when 1: 4 prompts of different lengths, one left-padded batch, 64 new tokens each."""
    transformers = pytest.importorskip("transformers")
    convert("to-hf", trained, str(tmp_path / "hf"), "--dtype", "fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = prompt_ids()
    longest = max(map(len, ids))
    batch = torch.full((len(ids), longest), TOK.pad_id)
    mask = torch.zeros_like(batch)
    for b, p in enumerate(ids):
        batch[b, longest - len(p) :], mask[b, longest - len(p) :] = torch.tensor(p), 1
    want = hf.generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=64, do_sample=False,
        pad_token_id=TOK.pad_id, eos_token_id=None,
    )[:, longest:].tolist()  # fmt: skip
    got = generate(model, ids, 64)
    assert got == want
    assert len({tuple(g) for g in got}) == 4 and all(len(set(g)) > 3 for g in got)


# --- llama.cpp ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_files(trained, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for dtype in ("f16", "q8_0"):
        files[dtype] = str(out / f"debug-{dtype}.gguf")
        convert("to-gguf", trained, files[dtype], "--dtype", dtype)
    return files


def llama(path: str):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False, n_threads=2)


def llama_greedy(llm, prompt: list[int], new: int) -> list[int]:
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(new):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


@needs_llama_cpp
def test_llama_cpp_f16_greedy_equals_titanlab(gguf_files, model):
    llm = llama(gguf_files["f16"])
    for prompt in prompt_ids():
        assert llama_greedy(llm, prompt, 48) == generate(model, [prompt], 48)[0]


@needs_llama_cpp
def test_llama_cpp_q8_0_perplexity_within_1_percent(gguf_files, model):
    import numpy as np

    llm = llama(gguf_files["q8_0"])
    windows = held_out_windows()
    nll, count = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = torch.from_numpy(np.array(llm.scores[: len(w)]))
        nll += torch.nn.functional.cross_entropy(
            logits[:-1], torch.tensor(w[1:]), reduction="sum"
        ).item()
        count += len(w) - 1
    ours, theirs = titanlab_perplexity(model, windows), math.exp(nll / count)
    print(f"held-out perplexity: titanlab fp32 {ours:.3f}, llama.cpp q8_0 {theirs:.3f}")
    assert abs(theirs / ours - 1) < 0.01


@needs_llama_cpp
def test_llama_cpp_tokenizer_gives_titanlab_ids_on_real_text(gguf_files):
    llm = llama(gguf_files["f16"])
    texts = [open(f, encoding="utf-8").read()[:20_000] for f in default_corpus_files()[:12]]
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        texts.append(f.read())
    texts.append("Grüße, 東京 — naïve café: 3.14159 × 2 ≠ 6; emoji 🙂\n\n\tindent\r\n")
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == TOK.encode(
            text, bos=False, eos=False
        )


@needs_llama_cpp
def test_llama_cpp_chat_template_gives_titanlab_chat_ids(gguf_files):
    jinja2 = pytest.importorskip("jinja2")
    llm = llama(gguf_files["f16"])
    assert llm.metadata["tokenizer.chat_template"] == LLAMA3_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "  Sort a dict by value.\n"},
        {"role": "assistant", "content": "sorted(d.items(), key=lambda kv: kv[1])"},
        {"role": "tool", "content": "[('a', 1)]"},
        {"role": "user", "content": "Thanks!"},
    ]
    text = jinja2.Template(LLAMA3_CHAT_TEMPLATE).render(
        messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=True
    )
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert ids == render_chat(TOK, messages, add_generation_prompt=True).ids


@needs_llama_cpp
def test_llama_cpp_runs_a_qwen3_export_in_its_layout(tmp_path):
    """Qwen3 (rotate-half RoPE in llama.cpp, q/k norms, tied embeddings), f32: logits equal."""
    import numpy as np

    from titanlab.models.registry import build_model, get_family, get_flavor
    from titanlab.models.stored_args import write_model_args
    import torch.distributed.checkpoint as dcp

    args = dataclasses.replace(
        get_flavor(get_family("qwen3"), "debugmodel"), dim=128, n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=32, hidden_dim=256, vocab_size=TOK.vocab_size, max_seq_len=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    qwen = build_model(args)
    qwen.init_weights()
    dcp.save({"model": qwen.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    write_model_args(str(tmp_path / "dcp"), get_family("qwen3"), args)
    convert("to-gguf", str(tmp_path / "dcp"), str(tmp_path / "q.gguf"), "--dtype", "f32")
    llm = llama(str(tmp_path / "q.gguf"))
    ids = prompt_ids()[3]
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)]))
    with torch.no_grad():
        ours = qwen.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0)
