"""`python -m titanlab.generate`: from a Hugging Face folder and from the titanlab DCP checkpoint
imported from it, the same greedy continuation as `generate` on the model; bad input is one line."""

import dataclasses
import json
import os

import pytest
import torch

from titanlab.generation import cli
from titanlab.checkpoint.convert import hf_to_dcp
from titanlab.data.tokenizer import default_tokenizer_path, load_tokenizer
from titanlab.generation import generate
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKENIZER = load_tokenizer(default_tokenizer_path())
ARGS = dataclasses.replace(
    llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
    vocab_size=TOKENIZER.vocab_size, max_seq_len=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(model, HF folder, DCP folder) of one tiny random Llama."""
    transformers = pytest.importorskip("transformers")
    from titanlab.models.llama3.hf import to_config

    torch.manual_seed(0)
    model = build_model(ARGS)
    model.init_weights()
    model.eval()
    root = tmp_path_factory.mktemp("gen")
    config = transformers.LlamaConfig(**to_config(ARGS, torch.float32, 128, None, None))
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(HFStateDictAdapter(ARGS).to_hf_state_dict(model.state_dict()))
    hf.save_pretrained(root / "hf")
    hf_to_dcp(str(root / "hf"), str(root / "dcp"), progress=False)
    return model, str(root / "hf"), str(root / "dcp")


@pytest.mark.parametrize("which", ["hf", "dcp"])
def test_cli_continues_each_prompt_as_generate_does(folders, capsys, which):
    model, hf, dcp = folders
    prompts = ["def main(", "import os\nimport"]
    code = cli.main([hf if which == "hf" else dcp, "--prompt", prompts[0], "--prompt", prompts[1],
                     "--max-new-tokens", "12"])  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    ids = [TOKENIZER.encode(p, bos=True, eos=False) for p in prompts]
    want = generate(model, ids, 12, eos_ids=[TOKENIZER.eos_id])
    texts = [p + TOKENIZER.decode(w) for p, w in zip(prompts, want)]
    assert captured.out == "".join(t + "\n---\n" for t in texts)
    assert "tokens/s" in captured.err.strip().splitlines()[-1]
    assert "KiB keys/values for" in captured.err.strip().splitlines()[-2]
    assert "linear-attention" not in captured.err  # Llama has no such state to report


def test_single_prompt_streams_the_same_text(folders, capsys):
    model, hf, _ = folders
    assert cli.main([hf, "--prompt", "class A:", "--max-new-tokens", "10"]) == 0
    ids = [TOKENIZER.encode("class A:", bos=True, eos=False)]
    want = generate(model, ids, 10, eos_ids=[TOKENIZER.eos_id])[0]
    assert capsys.readouterr().out == "class A:" + TOKENIZER.decode(want) + "\n"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--max-new-tokens", "1000000"], "+ max_new_tokens=1000000 exceeds max_seq_len="),
        ([], "no prompt; give --prompt TEXT, --prompt-file FILE or --chat FILE"),
        (["--chat", "/nonexistent.jsonl"], "chat file '/nonexistent.jsonl': No such file"),
        (["--mtp-draft"], "(mtp_layers=0) has none: decode without the draft"),
    ],
)
def test_bad_input_is_one_line(folders, capsys, extra, message):
    _, hf, _ = folders
    prompt = [] if not extra or extra[0] == "--chat" else ["--prompt", "x"]
    assert cli.main([hf, *prompt, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanlab: error: ") and message in err[0]


def test_an_error_after_the_stream_began_starts_on_a_line_of_its_own(folders, capsys, monkeypatch):
    """The prompt and the first tokens are on stdout without a newline when an error comes: the
    error line is not glued to them (`hititanlab: error: ...`)."""
    _, hf, _ = folders

    def fails_after_a_token(model, ids, max_new_tokens, *, on_step, **kwargs):
        on_step([ids[0][-1]])
        raise ValueError("the decode stopped")

    monkeypatch.setattr(cli, "generate", fails_after_a_token)
    assert cli.main([hf, "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("hi") and out.endswith("\n") and out.count("\n") == 1
    assert err == "titanlab: error: the decode stopped\n"


def test_unknown_checkpoint_folder_is_one_line(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"titanlab: error: checkpoint {str(tmp_path / 'nope')!r} is not a "
                   "folder; give a step-N, export-step-N or Hugging Face folder"]  # fmt: skip


def test_under_torchrun_two_ranks_print_what_one_process_prints(folders, capsys):
    import subprocess
    import sys

    _, hf, _ = folders
    args = [hf, "--prompt", "def main(", "--prompt", "x = [", "--max-new-tokens", "16"]
    assert cli.main(args) == 0
    want = capsys.readouterr().out
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "titanlab.generate", *args],
        cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want


def test_chat_file_is_rendered_with_the_template_and_answered(folders, capsys, tmp_path):
    from titanlab.data.chat import render_chat

    model, hf, _ = folders
    messages = [{"role": "user", "content": "Write a loop."}]
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": messages * 2}) + "\n"
    )
    assert cli.main([hf, "--chat", str(path), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    ids = [
        render_chat(TOKENIZER, m, add_generation_prompt=True).ids for m in (messages, messages * 2)
    ]
    want = generate(model, ids, 8, eos_ids=[TOKENIZER.eos_id, TOKENIZER.eot_id])
    assert out == "".join(
        TOKENIZER.decode(i) + TOKENIZER.decode(w) + "\n---\n" for i, w in zip(ids, want)
    )
    assert out.count("<|start_header_id|>assistant<|end_header_id|>") == 2
