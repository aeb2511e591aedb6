"""Chat SFT in the trainer: prepared conversations train packed (document masking and restarted
positions forced on, assistant tokens only), and FSDP 2 equals 1 process (1e-5, 5 steps, one
seed checkpoint)."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from titanlab.data.default_corpus import default_corpus_files  # noqa: E402
from titanlab.data.prepare_chat import prepare_chat  # noqa: E402
from titanlab.data.tokenizer import default_tokenizer_path  # noqa: E402
from titanlab.distributed.layouts import Layout  # noqa: E402
from tools import parity_matrix  # noqa: E402


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> str:
    """Conversations asking for a stdlib function's docstring, answered with it."""
    import ast

    root = tmp_path_factory.mktemp("chat")
    with open(root / "chats.jsonl", "w", encoding="utf-8") as out:
        for path in default_corpus_files()[:30]:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                    messages = [
                        {"role": "user", "content": f"What does {node.name} do?"},
                        {"role": "assistant", "content": ast.get_docstring(node)[:300]},
                    ]
                    out.write(json.dumps({"messages": messages}) + "\n")
    prepare_chat([str(root / "chats.jsonl")], str(root / "sft"), default_tokenizer_path(),
                 progress=False)  # fmt: skip
    return str(root / "sft")


@pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1",
    reason="chat data × FSDP 2 is a row of the feature-pair matrix in CI; make test-parity-full",
)
def test_fsdp2_chat_sft_equals_one_process(chats, tmp_path):
    root = str(tmp_path)
    dataset, seed, losses = parity_matrix.prepare_reference(root, chats)
    outcome = parity_matrix.run_layout(Layout(1, 2, 1, 1, None, 1), dataset, seed, losses, root)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff
    assert losses[parity_matrix.STEPS] < losses[1]
