"""Sequence-length warmup in the trainer: a run stopped before the step where seq_len grows
and resumed trains to the same losses, bit for bit, as the uninterrupted run; the log names
each change."""

import json
import os

from conftest import CONSTANT_LR, TINY, launch

WARMUP = ["--model.flavor", "debugmodel_deep", "--training.seq_len", "64",
          "--training.seq_len_warmup_steps", "12", "--training.seq_len_warmup_start", "16",
          "--training.local_batch_size", "4", "--checkpoint.enable", "true"]  # fmt: skip


def losses(dump: str) -> dict[int, float]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {rec["step"]: rec["loss"] for rec in map(json.loads, f)}


def test_resume_across_the_length_change_is_exact(tiny_dataset, tmp_path):
    def run(dump, steps, *extra):
        return launch(1, [*TINY, *CONSTANT_LR, *WARMUP, "--data.dataset_path", tiny_dataset,
                          "--job.dump_folder", dump, "--training.steps", str(steps),
                          *extra]).check()  # fmt: skip

    whole = run(str(tmp_path / "whole"), 14, "--checkpoint.interval", "100")
    for step, seq in ((1, 16), (5, 32), (9, 64)):
        assert f"seq_len warmup: from step {step} the model sees {seq}-token sequences" in (
            whole.stdout
        )
    parted = str(tmp_path / "parted")
    run(parted, 6, "--checkpoint.interval", "6")  # stops inside the 32-token stage
    run(parted, 14, "--checkpoint.interval", "100")
    want, got = losses(str(tmp_path / "whole")), losses(parted)
    assert sorted(got) == list(range(1, 15)) and got == want
    assert want[14] < want[1]
