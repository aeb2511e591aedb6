"""Chat SFT data: prepared ids and loss mask equal the rendered conversation plus EOS; packing
keeps samples whole and masks what is not a target; a packed window's block-causal forward
equals each sample run alone (1e-5, fp32); bad conversations are one line."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from titanlab.data.chat import render_chat
from titanlab.data.document_masking import DocumentMasking
from titanlab.data.prepare_chat import prepare_chat
from titanlab.data.sft_dataset import PackedChatDataset, is_chat_folder
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.data.labels import IGNORE_INDEX
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOK = Tokenizer(default_tokenizer_path())
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 4))
        answer = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 7))
        conv = [{"role": "user", "content": f"Say {question}."},
                {"role": "assistant", "content": answer}]  # fmt: skip
        if i % 3 == 0:
            conv.insert(0, {"role": "system", "content": "You repeat words."})
        out.append(conv)
    return out


@pytest.fixture
def prepared(tmp_path):
    convs = conversations(40)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    prepare_chat([str(src)], str(tmp_path / "sft"), default_tokenizer_path(), progress=False)
    return str(tmp_path / "sft"), convs


def test_prepared_ids_and_mask_are_the_rendered_conversations(prepared):
    folder, convs = prepared
    assert is_chat_folder(folder)
    meta = json.load(open(os.path.join(folder, "metadata.json")))
    assert meta["train_on"] == "assistant" and meta["total_documents"] == 40
    ds = PackedChatDataset(folder, 4096, val_fraction=0, packing=False)
    for i in (0, 1, 7):
        inputs, labels = ds[i]
        want = render_chat(TOK, convs[i], add_generation_prompt=False)
        n = len(want.ids) + 1  # + EOS
        assert inputs[:n].tolist() == [*want.ids, TOK.eos_id]
        # labels: the next token where it is an assistant token, else ignored (EOS included)
        targets = [*want.assistant_mask[1:], False]
        expect = [
            t if keep else IGNORE_INDEX for t, keep in zip([*want.ids[1:], TOK.eos_id], targets)
        ]
        assert labels[: n - 1].tolist() == expect[: n - 1]
        assert (labels[n - 1 :] == IGNORE_INDEX).all() and (inputs[n:] == TOK.pad_id).all()


def test_packing_keeps_samples_whole(prepared):
    folder, convs = prepared
    samples = [[*render_chat(TOK, c, add_generation_prompt=False).ids, TOK.eos_id] for c in convs]
    ds = PackedChatDataset(folder, 96, val_fraction=0)
    assert len(ds) < len(convs)  # several samples per window
    assert [w[0] for w in ds._windows[1:]] == [w[1] for w in ds._windows[:-1]]  # in order
    assert ds._windows[0][0] == 0 and ds._windows[-1][1] == len(convs)
    for w, (first, last) in enumerate(ds._windows):
        whole = [t for s in samples[first:last] for t in s]
        assert len(whole) <= 97  # whole samples only
        inputs, _ = ds[w]
        assert inputs.tolist() == (whole + [TOK.pad_id] * 97)[:96]
    assert ds.truncated == 0
    short = PackedChatDataset(folder, 16, val_fraction=0, packing=False)
    assert short.truncated == sum(len(s) > 17 for s in samples) > 0


def test_packed_window_equals_each_sample_run_alone(prepared):
    folder, convs = prepared
    ds = PackedChatDataset(folder, 128, val_fraction=0)
    inputs, labels = (t[None] for t in ds[0])
    args = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4,
                               n_kv_heads=2, vocab_size=TOK.vocab_size, max_seq_len=128)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    model.eval()
    labels, kwargs = DocumentMasking(TOK.eos_id, reset_positions=True).apply(inputs, labels)
    with torch.no_grad():
        packed = model(inputs, **kwargs)[0]
        at, samples = 0, 0
        for conv in convs:
            ids = [*render_chat(TOK, conv, add_generation_prompt=False).ids, TOK.eos_id]
            if at + len(ids) > 128:
                break
            alone = model(torch.tensor([ids]))[0]
            torch.testing.assert_close(packed[at : at + len(ids)], alone, atol=1e-5, rtol=0)
            at, samples = at + len(ids), samples + 1
    assert samples >= 3


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "hi"}', "line 1 has no 'messages'"),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}',
            "message 0 has role 'robot'; valid: ",
        ),
    ],
)
def test_bad_conversations_are_one_line(tmp_path, line, message):
    src = tmp_path / "bad.jsonl"
    src.write_text(line + "\n")
    proc = subprocess.run(
        [sys.executable, "tools/prepare_data.py", str(src), "--format", "chat", "--output",
         str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("prepare_data: error:")
    assert message in lines[0]
