"""Chat conversations rendered into token ids with the Llama 3 chat format.

Format (Meta, "Llama 3 model card: prompt format"; Llama 3.1 names the tool role `ipython`)::

    <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|> ...
    <|start_header_id|>assistant<|end_header_id|>\\n\\n          (the generation prompt)

Each message's content is stripped of surrounding whitespace, as Meta's template does. An
assistant message's optional `reasoning` goes before its content as
`<think>\n{reasoning}\n</think>\n\n` (a reasoning trace, as Qwen3 and DeepSeek-R1 format it;
the Llama 3 vocabulary has no think tokens, so the tags are ordinary text) and is trained on
like the content. The same
format as a Jinja template (`LLAMA3_CHAT_TEMPLATE`) goes into exported files (GGUF's
`tokenizer.chat_template`), so llama.cpp renders a conversation into the same ids.

A conversation is a list of `{"role": ..., "content": ...}` dicts (optionally `reasoning`),
roles `system`, `user`, `assistant`, `tool`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from titanlab.data.tokenizer import AnyTokenizer, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
_HEADER_NAME = {"tool": "ipython"}  # Llama 3.1's name for a tool's output

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>\n\n"
    "{% if message['reasoning'] is defined and message['reasoning'] %}"
    "<think>\n{{ message['reasoning'] | trim }}\n</think>\n\n{% endif %}"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""The Llama 3 chat format as a Jinja template (variables `messages`, `bos_token`,
`add_generation_prompt`), equal to `render_chat` on every conversation."""


@dataclass
class ChatTokens:
    """A rendered conversation.

    ids: token ids, starting with BOS.
    assistant_mask: per id, True where it belongs to an assistant message's content or its
        closing `<|eot_id|>` (the tokens supervised fine-tuning trains on).
    """

    ids: list[int]
    assistant_mask: list[bool]


def check_messages(messages: Any, where: str = "conversation") -> list[dict[str, str]]:
    """`messages` validated as a list of {"role", "content"} dicts with known roles.

    Raises:
        ValueError: one line naming `where`, the bad message and what is valid.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} needs a string 'content' and a 'role'")
        if not isinstance(m.get("reasoning", ""), str):
            raise ValueError(f"{where}: message {i} has a 'reasoning' that is not a string")
        if m.get("role") not in ROLES:
            raise ValueError(
                f"{where}: message {i} has role {m.get('role')!r}; valid: {', '.join(ROLES)}"
            )
    return messages


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool
) -> ChatTokens:
    """Token ids of a conversation in the Llama 3 chat format (see the module docstring).

    Args:
        tokenizer: a Llama 3 format (tiktoken) tokenizer, which has the header / eot tokens.
        messages: the conversation (checked by `check_messages`).
        add_generation_prompt: end with the assistant header, for the model to answer.
    Raises:
        ValueError: a malformed conversation (one line).
    """
    check_messages(list(messages))
    special = tokenizer.special_tokens
    start, end, eot = (
        special["<|start_header_id|>"],
        special["<|end_header_id|>"],
        special["<|eot_id|>"],
    )
    ids, mask = [tokenizer.bos_id], [False]

    def add(new: list[int], trained: bool) -> None:
        ids.extend(new)
        mask.extend([trained] * len(new))

    def header(role: str) -> None:
        add([start, *tokenizer.encode(role, bos=False, eos=False), end], False)
        add(tokenizer.encode("\n\n", bos=False, eos=False), False)

    for m in messages:
        header(_HEADER_NAME.get(m["role"], m["role"]))
        trained = m["role"] == "assistant"
        if m.get("reasoning"):
            think = f"<think>\n{m['reasoning'].strip()}\n</think>\n\n"
            add(tokenizer.encode(think, bos=False, eos=False), trained)
        add(tokenizer.encode(m["content"].strip(), bos=False, eos=False), trained)
        add([eot], trained)
    if add_generation_prompt:
        header("assistant")
    return ChatTokens(ids, mask)


@dataclass
class ChatPrompt:
    """A conversation rendered for the model to answer: `ids` end with the assistant header;
    `stop_ids` end the answer (the template's end of turn)."""

    ids: list[int]
    stop_ids: list[int]


def render_chat_prompt(tokenizer: AnyTokenizer, messages: list[dict[str, str]]) -> ChatPrompt:
    """A conversation as a generation prompt: the Llama 3 format for a tiktoken tokenizer; for a
    tokenizer.json, the Jinja `chat_template` of its tokenizer_config.json (rendered with
    `jinja2`, special tokens in the text encoded as their ids; stop on EOS and ChatML's
    `<|im_end|>` where the vocabulary has it).

    Raises:
        ValueError: a malformed conversation, a tokenizer.json without a chat template, or
            `jinja2` not installed (one line each).
    """
    if isinstance(tokenizer, Tokenizer):
        rendered = render_chat(tokenizer, messages, add_generation_prompt=True)
        return ChatPrompt(rendered.ids, [tokenizer.eot_id])
    check_messages(messages)
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {tokenizer.path!r} has no chat_template in tokenizer_config.json; "
            "--chat needs one"
        )
    try:
        import jinja2
    except ImportError:
        raise ValueError(
            "--chat with a tokenizer.json template needs jinja2: pip install jinja2"
        ) from None
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    bos = "" if tokenizer.bos_id is None else tokenizer.decode([tokenizer.bos_id])
    text = env.from_string(tokenizer.chat_template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=bos,
        eos_token=tokenizer.decode([tokenizer.eos_id]),
    )
    stop = [tokenizer.eos_id]
    im_end = tokenizer.token_id("<|im_end|>")
    if im_end is not None and im_end not in stop:
        stop.append(im_end)
    return ChatPrompt(tokenizer.encode(text, bos=False, eos=False), stop)


def read_chat_jsonl(path: str) -> list[list[dict[str, str]]]:
    """The conversations of a JSONL file: one `{"messages": [...]}` object per line.

    Raises:
        ValueError: unreadable file, a line that is not JSON, lacks `messages` or has a bad
            message (one line naming the file and line number).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"chat file {path!r}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "messages" not in obj:
            raise ValueError(f"{where} has no 'messages'; each line is {{\"messages\": [...]}}")
        out.append(check_messages(obj["messages"], where))
    if not out:
        raise ValueError(f"chat file {path!r} holds no conversation")
    return out
