"""Chat SFT in the trainer: prepared conversations train packed (document masking and restarted
positions forced on, assistant tokens only), and FSDP 2 equals 1 process (1e-5, 3 steps, one
seed checkpoint)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from titanlab.planning.layouts import Layout  # noqa: E402
from tools import parity_matrix  # noqa: E402
from tools.lib.feature_runs import write_chat_data  # noqa: E402


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> str:
    """Conversations asking for a stdlib function's docstring, answered with it."""
    out = str(tmp_path_factory.mktemp("chat") / "sft")
    write_chat_data(out)
    return out


@pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1",
    reason="chat data × FSDP 2 is a row of the feature-pair matrix in CI; make test-parity-full",
)
@pytest.mark.cover("chat-sft×dp_shard", "llama3×dp_shard")
def test_fsdp2_chat_sft_equals_one_process(chats, tmp_path):
    root = str(tmp_path)
    dataset, seed, losses = parity_matrix.prepare_reference(root, chats)
    outcome = parity_matrix.run_layout(Layout(1, 2, 1, 1, None, 1), dataset, seed, losses, root)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff
    assert losses[parity_matrix.STEPS] < losses[1]
