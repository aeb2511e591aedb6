"""The prompt stream: held-out prompts never drawn, a resumed stream continues exactly, each dp
rank draws its own, JSONL prompts are chat-rendered with their answers as metadata, and another
source's state or a bad line is refused in one line."""

from __future__ import annotations

import json

import pytest

from titanlab.config.errors import ConfigError
from titanlab.data.digit_tasks import EOS, DigitTask, is_held_out
from titanlab.data.tokenizer import default_tokenizer_path, load_tokenizer
from titanlab.posttrain.rl.prompts import PromptStream, read_prompts


def test_the_stream_never_draws_a_held_out_prompt_and_resumes_where_it_stopped():
    task = DigitTask("reverse", 4)
    held = {tuple(p) for p, _ in task.held_out_set(64, seed=0)}
    assert len(held) == 64 and all(is_held_out(list(p[1:-1])) for p in held)
    stream = PromptStream(task, seed=0, dp_rank=0)
    first = [e.ids for e in stream.next(500)]
    assert not held & {tuple(p) for p in first}
    assert {tuple(e.ids) for e in stream.evaluation_prompts(64)} == held
    state = stream.state_dict()
    after = stream.next(7)
    resumed = PromptStream(task, seed=0, dp_rank=0)
    resumed.load_state_dict(state)
    assert resumed.next(7) == after
    other_rank = [e.ids for e in PromptStream(task, seed=0, dp_rank=1).next(50)]
    assert other_rank != first[:50]  # each dp rank draws its own prompts
    e = after[0]
    assert e.text == "^" + "".join(map(str, e.ids[1:-1])) + "="
    assert e.metadata["answer"] == e.text[-2:0:-1] and e.metadata["target"][-1] == EOS


def test_the_add_task_has_a_plus_and_the_sum_as_answer():
    stream = PromptStream(DigitTask("add", 3), seed=0, dp_rank=0)
    for e in stream.next(20):
        a, b = e.text[1:-1].split("+")
        assert len(a) == len(b) == 3 and e.metadata["answer"] == str(int(a) + int(b))


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_are_chat_rendered_split_between_ranks_and_resume(tmp_path):
    tok = load_tokenizer(default_tokenizer_path())
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3}
            for i in range(35)]  # fmt: skip
    examples, stop_ids = read_prompts(write_jsonl(tmp_path / "p.jsonl", rows), tok)
    assert stop_ids == [tok.eot_id] and len(examples) == 35
    e = examples[3]
    assert e.ids[0] == tok.bos_id and "What is 3 + 3?" in tok.decode(e.ids)
    assert e.text == "What is 3 + 3?" and e.metadata == {"answer": "6", "level": 0}
    a = PromptStream(examples, 0, 0, 2, tokenizer=tok, stop_ids=stop_ids, format_pattern="x+")
    b = PromptStream(examples, 0, 1, 2, tokenizer=tok, stop_ids=stop_ids)
    first, second = a.next(16), b.next(16)  # 32 training lines = one epoch over the ranks
    assert sorted(x.text for x in first + second) == sorted(x.text for x in a.train)
    held = {x.text for x in a.evaluation_prompts(64)}
    assert len(held) == 3 and not held & {x.text for x in first}
    assert first[0].metadata["format_pattern"] == "x+"
    state = a.state_dict()
    again = PromptStream(examples, 0, 0, 2, tokenizer=tok, stop_ids=stop_ids, format_pattern="x+")
    again.load_state_dict(state)
    assert again.next(4) == a.next(4)
    with pytest.raises(ConfigError, match="prompts are 35 JSONL prompts, this run's are task"):
        PromptStream(DigitTask("reverse", 4), 0, 0).load_state_dict(state)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 1 is not JSON"),
        (json.dumps({"prompt": "hi"}), 'line 1 needs a string "answer"'),
        (json.dumps({"prompt": 3, "answer": "1"}), 'line 1 needs a string "prompt"'),
        (json.dumps({"prompt": " ", "answer": "1"}), 'line 1: "prompt" is empty'),
    ],
)
def test_a_bad_jsonl_line_is_one_line_naming_it(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError) as e:
        read_prompts(str(path), load_tokenizer(default_tokenizer_path()))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_too_few_prompts_and_a_missing_file_are_refused(tmp_path):
    tok = load_tokenizer(default_tokenizer_path())
    rows = [{"prompt": "p", "answer": "a"}] * 5
    with pytest.raises(ConfigError, match="has 5 prompts; at least 17 are needed"):
        read_prompts(write_jsonl(tmp_path / "few.jsonl", rows), tok)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_prompts(str(tmp_path / "none.jsonl"), tok)


def test_resuming_another_tasks_stream_is_refused_in_one_line():
    state = PromptStream(DigitTask("sort", 5), 0, 0).state_dict()
    with pytest.raises(
        ConfigError, match="prompts are task sort of 5 digits, this run's are task reverse of 4"
    ):
        PromptStream(DigitTask("reverse", 4), 0, 0).load_state_dict(state)


def test_resuming_against_another_reference_policy_is_refused_in_one_line():
    stream = PromptStream(DigitTask("reverse", 4), 0, 0)
    stream.reference = "seed 0"
    state = stream.state_dict()
    again = PromptStream(DigitTask("reverse", 4), 0, 0)
    again.reference = "/ckpt/base"
    with pytest.raises(
        ConfigError, match="trained against the reference policy seed 0, this run's is /ckpt/base"
    ):
        again.load_state_dict(state)
    again.reference = "seed 0"
    again.load_state_dict(state)
    assert again.drawn == 0
