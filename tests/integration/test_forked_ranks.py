"""Ranks forked from the preloaded server (`tools.lib.fork_launch`, what the integration tests
use) train exactly as under torchrun, and a refusal keeps its line and exit code."""

import re

import pytest

from conftest import TINY
from tools.lib.runs import launch, read_losses


@pytest.mark.cover("launch:warm-ranks", "launch:torchrun")
def test_two_forked_ranks_train_exactly_like_torchrun_and_refusals_keep_their_line(
    tiny_dataset, tmp_path
):
    args = [*TINY, "--training.steps", "2",
            "--data.dataset_path", tiny_dataset, "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    runs = {}
    for name, torchrun in (("fork", False), ("torchrun", True)):
        dump = str(tmp_path / name)
        proc = launch(2, [*args, "--job.dump_folder", dump], torchrun=torchrun)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs[name] = read_losses(dump)
    assert runs["fork"] == runs["torchrun"] and sorted(runs["fork"]) == [1, 2]
    bad = launch(2, [*args, "--training.steps", "0", "--job.dump_folder", str(tmp_path / "bad")])
    assert bad.returncode == 2
    assert "titanlab: error: training.steps" in bad.stderr
    # Both ranks refuse; whichever exits first is reported with its code (2), the other
    # stopped by SIGTERM (fork_launch's contract, as torchrun's).
    assert re.search(r"rank [01] exitcode : 2\n", bad.stderr), bad.stderr
