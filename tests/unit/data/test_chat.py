"""The Llama 3 chat format: ids and assistant mask against a hand-built expectation, the Jinja
template equal to the renderer, conversations from JSONL, bad input one line."""

import json

import pytest

from titanlab.data.chat import (
    LLAMA3_CHAT_TEMPLATE,
    check_messages,
    read_chat_jsonl,
    render_chat,
    render_chat_prompt,
)
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path, load_tokenizer

TOK = Tokenizer(default_tokenizer_path())
S = TOK.special_tokens
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " What is 2+2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "ok"},
]
REASONING = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5", "reasoning": " two plus three "},
]


def enc(text: str) -> list[int]:
    return TOK.encode(text, bos=False, eos=False)


def test_ids_and_assistant_mask_are_the_llama3_format():
    got = render_chat(TOK, MESSAGES, add_generation_prompt=True)
    start, end, eot = S["<|start_header_id|>"], S["<|end_header_id|>"], S["<|eot_id|>"]

    def header(role):
        return [start, *enc(role), end, *enc("\n\n")]

    want = [TOK.bos_id]
    mask = [False]
    for role, content, trained in [
        ("system", "Be brief.", False),
        ("user", "What is 2+2?", False),  # content stripped, as Meta's template trims it
        ("assistant", "4", True),
        ("ipython", "ok", False),  # Llama 3.1's name for a tool's output
    ]:
        want += header(role)
        mask += [False] * len(header(role))
        want += [*enc(content), eot]
        mask += [trained] * (len(enc(content)) + 1)
    want += header("assistant")
    mask += [False] * len(header("assistant"))
    assert got.ids == want and got.assistant_mask == mask
    assert sum(got.assistant_mask) == len(enc("4")) + 1  # the answer and its end of turn


def test_jinja_template_renders_the_same_text():
    jinja2 = pytest.importorskip("jinja2")
    for messages in (MESSAGES, REASONING):
        for prompt in (False, True):
            text = jinja2.Template(LLAMA3_CHAT_TEMPLATE).render(
                messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=prompt
            )
            ids = render_chat(TOK, messages, add_generation_prompt=prompt).ids
            assert text == TOK.decode(ids)


def test_reasoning_is_wrapped_in_think_tags_and_trained_on():
    got = render_chat(TOK, REASONING, add_generation_prompt=False)
    trained = [i for i, m in zip(got.ids, got.assistant_mask) if m]
    assert TOK.decode(trained) == "<think>\ntwo plus three\n</think>\n\n5<|eot_id|>"


def test_tokenizer_json_prompt_uses_its_own_template(tmp_path):
    """A tokenizer.json folder renders with the chat_template of its tokenizer_config.json and
    stops at ChatML's <|im_end|> when the vocabulary has it."""
    pytest.importorskip("jinja2")
    from tokenizers import AddedToken, Tokenizer as HF, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz :\n")}
    hf = HF(models.BPE(vocab, []))
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": template})
    )
    tok = load_tokenizer(str(tmp_path))
    prompt = render_chat_prompt(tok, [{"role": "user", "content": "hi"}])
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    body = tok.encode("user\nhi", bos=False, eos=False)
    assert prompt.ids == [im_start, *body, im_end, *tok.encode("\n", bos=False, eos=False),
                          im_start, *tok.encode("assistant\n", bos=False, eos=False)]  # fmt: skip
    assert prompt.stop_ids == [im_end]


def test_read_chat_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"messages": MESSAGES[:2]}) + "\n\n" + json.dumps({"messages": MESSAGES}) + "\n"
    )
    assert read_chat_jsonl(str(path)) == [MESSAGES[:2], MESSAGES]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "hi"}', "line 2 has no 'messages'; each line is"),
        ("not json", "line 2 is not JSON"),
        ('{"messages": []}', "line 2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}',
         "message 0 has role 'bot'; valid: system, user, assistant, tool"),
        ('{"messages": [{"role": "user"}]}', "message 0 needs a string 'content'"),
    ],
)  # fmt: skip
def test_bad_conversations_are_one_line(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        read_chat_jsonl(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_check_messages_rejects_a_non_list():
    with pytest.raises(ValueError, match="'messages' must be a non-empty list"):
        check_messages({"role": "user"})
