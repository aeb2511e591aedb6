"""DPO: the loss against a hand-computed case, the packing masks, and the pair sources (digit
pairs, JSONL rendered with the chat template, one line for a bad pair, resumable order)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from titanlab.config.errors import ConfigError
from titanlab.data.digit_tasks import EOS, DigitTask
from titanlab.data.tokenizer import default_tokenizer_path, load_tokenizer
from titanlab.posttrain.rl.dpo import dpo_loss, pack
from titanlab.posttrain.rl.pairs import PairStream, read_pairs


def test_dpo_loss_against_a_hand_computed_case():
    # log π(y_w) = −3, log π_ref(y_w) = −4; log π(y_l) = −5, log π_ref(y_l) = −4.5; β = 0.1
    loss, r_w, r_l = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([-4.0]),
                              torch.tensor([-4.5]), 0.1)  # fmt: skip
    assert r_w.item() == pytest.approx(0.1) and r_l.item() == pytest.approx(-0.05)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.15))), rel=1e-6)
    # at the reference: log 2, and the gradient pushes the chosen up and the rejected down
    w, l = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _, _ = dpo_loss(w, l, torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    assert w.grad.item() == pytest.approx(-0.25) and l.grad.item() == pytest.approx(0.25)


def test_pack_masks_the_prompt_and_the_padding_by_position():
    pairs = [([10, 1, 2, 11], [2, 1, EOS], [2, 0, EOS]), ([10, 3, 11], [3, EOS], [4, 4, 4, EOS])]
    seqs, mask = pack(pairs, torch.device("cpu"))
    assert seqs.shape == (4, 7) and mask.shape == (4, 6)
    assert seqs[3].tolist() == [10, 3, 11, 4, 4, 4, EOS]
    # target t predicts token t + 1: the completion's tokens are targets len(prompt) - 1 ...
    assert mask[0].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [False, False, True, True, False, False]  # then padding
    assert mask[3].tolist() == [False, False, True, True, True, True]


def test_digit_pairs_differ_in_one_digit_and_resume_in_order():
    task = DigitTask("reverse", 4)
    stream = PairStream(task, seed=0, dp_rank=0, dp=2)
    pairs = stream.next(50)
    for prompt, chosen, rejected in pairs:
        assert chosen == task.answer(prompt[1:-1])
        assert sum(a != b for a, b in zip(chosen, rejected)) == 1 and rejected[-1] == EOS
    state = stream.state_dict()
    again = PairStream(task, 0, 0, 2)
    again.load_state_dict(state)
    assert again.next(5) == stream.next(5)
    held = {tuple(p) for p, _, _ in stream.evaluation_pairs(64)}
    assert not held & {tuple(p) for p, _, _ in pairs}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_pairs_are_chat_rendered_and_split_between_ranks(tmp_path):
    tok = load_tokenizer(default_tokenizer_path())
    rows = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
            for i in range(35)]  # fmt: skip
    pairs = read_pairs(write_jsonl(tmp_path / "p.jsonl", rows), tok)
    prompt, chosen, rejected = pairs[3]
    assert prompt[0] == tok.bos_id and "What is 3 + 3?" in tok.decode(prompt)
    assert tok.decode(chosen[:-1]) == "6" and chosen[-1] == tok.eot_id
    assert tok.decode(rejected[:-1]) == "7"
    a, b = PairStream(pairs, 0, 0, 2), PairStream(pairs, 0, 1, 2)
    first, second = a.next(16), b.next(16)  # 32 training lines = one epoch over the ranks
    assert sorted(map(str, first + second)) == sorted(map(str, a.train))
    assert len(a.held_out) == 3 and not {str(p) for p in a.held_out} & {str(p) for p in first}


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "q", "chosen": "a", "rejected": "  "}, '"rejected" is empty'),
        ({"prompt": "q", "chosen": "a"}, 'needs a string "rejected"'),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, 'needs a string "prompt"'),
    ],
)
def test_a_bad_pair_is_one_line_naming_its_line(tmp_path, row, says):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "p.jsonl", [good] * 5 + [row] + [good] * 20)
    with pytest.raises(ConfigError) as e:
        read_pairs(path, load_tokenizer(default_tokenizer_path()))
    assert "line 6" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_jsonl_completions_of_a_qwen3_base_tokenizer_end_with_its_eos(tmp_path):
    """A Qwen3-Base-style tokenizer.json (EOS <|endoftext|>, ChatML template ending each turn
    with <|im_end|>): each completion is its text then the tokenizer's EOS, as TRL's DPOTrainer
    appends, and holds no <|im_end|>."""
    pytest.importorskip("jinja2")
    from tokenizers import AddedToken, Tokenizer as HF, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789 ?+\n")}  # 40
    hf = HF(models.BPE(vocab, []))
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 40, 41, 42
    hf.add_special_tokens([AddedToken(t, special=True) for t in specials])
    hf.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "chat_template": template}))  # fmt: skip
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")) == (40, 41, 42)
    rows = [{"prompt": f"what is {i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
            for i in range(20)]  # fmt: skip
    prompt, chosen, rejected = read_pairs(write_jsonl(tmp_path / "p.jsonl", rows), tok)[3]
    generation_prompt = [41, *tok.encode("assistant\n", bos=False, eos=False)]
    assert prompt[-len(generation_prompt) :] == generation_prompt
    assert chosen == [vocab["6"], 40]  # "6" <|endoftext|>
    assert rejected == [vocab["7"], 40]  # "7" <|endoftext|>
