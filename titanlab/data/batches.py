"""What happens to a batch between the loader and the model: the sequence-length warmup's
split, document masking, and (debug.record_batches) a record of the token ids.

`BatchPreparer.prepare` turns the loader's (inputs, labels) microbatches of one step into
(inputs, labels, model keyword arguments) triples; the trainer runs those.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from titanlab.config.job_config import JobConfig
from titanlab.data.document_masking import DocumentMasking
from titanlab.data.seq_len_warmup import split_windows, warmup_seq_len

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchPreparer:
    """Args:
    config: the run's config (training.seq_len*, debug.record_batches, job.dump_folder).
    masking: document masking, or None.
    rank / dp_rank: this process's global and data-parallel rank (record file and lines).
    """

    def __init__(
        self, config: JobConfig, masking: DocumentMasking | None, rank: int, dp_rank: int
    ) -> None:
        self.training = config.training
        self.masking = masking
        self.rank, self.dp_rank = rank, dp_rank
        self.record_dir = (
            os.path.join(config.job.dump_folder, "batches") if config.debug.record_batches else ""
        )
        self._seq_len = config.training.seq_len

    def record(self, step: int, batches: list[Batch]) -> None:
        """debug.record_batches: append `step`'s input and label ids (this rank's microbatches,
        as the loader gave them) to `batches/rank<N>.jsonl`. A no-op otherwise."""
        if not self.record_dir:
            return
        os.makedirs(self.record_dir, exist_ok=True)
        ids = [row for inputs, _ in batches for row in inputs.tolist()]
        labels = [row for _, targets in batches for row in targets.tolist()]
        line = {"step": step, "dp_rank": self.dp_rank, "inputs": ids, "labels": labels}
        with open(os.path.join(self.record_dir, f"rank{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def seq_len(self, step: int) -> int:
        """The sequence length training step `step` uses (the warmup's, else seq_len)."""
        t = self.training
        return warmup_seq_len(step, t.seq_len, t.seq_len_warmup_start, t.seq_len_warmup_steps)

    def prepare(
        self, step: int, batches: list[Batch]
    ) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
        """(inputs, labels, model kwargs) of each microbatch of training step `step`."""
        seq = self.seq_len(step)
        if seq != self.training.seq_len:
            batches = [split_windows(i, t, seq) for i, t in batches]
        if seq != self._seq_len:
            self._seq_len = seq
            logger.info("seq_len warmup: from step %d the model sees %d-token sequences", step, seq)
        return [self.model_inputs(i, t) for i, t in batches]

    def model_inputs(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(inputs, labels, model kwargs) of one (bs, seq) batch: with document masking, labels
        without cross-document targets and the `segments` / `positions` the model takes."""
        if self.masking is None:
            return inputs, labels, {}
        labels, kwargs = self.masking.apply(inputs, labels)
        return inputs, labels, kwargs
