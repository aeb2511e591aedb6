"""The memory estimate against the peak that PyTorch's memory profiler measures on CPU.

One training step (forward, loss, backward, AdamW step) of a small Llama runs under
`torch.profiler` with memory profiling; the peak of the categorized memory timeline (parameters,
optimizer state, gradients, activations, autograd temporaries) is compared with
`estimate_memory(...).peak_tensors`, which excludes the fixed runtime overhead.
"""

import dataclasses

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline

from titanlab.config.job_config import JobConfig
from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.loss import cross_entropy_sum
from titanlab.memory import estimate_memory
from titanlab.models.llama3 import Transformer, llama3_flavors
from titanlab.optim import OptimizersContainer

ARGS = dataclasses.replace(
    llama3_flavors["debugmodel"], n_layers=4, vocab_size=4352, max_seq_len=256
)
BATCH, SEQ = 4, 256


def config(mode: str, option: str) -> JobConfig:
    c = JobConfig()
    c.training.seq_len, c.training.local_batch_size = SEQ, BATCH
    c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option = mode, option
    return c


def measured_peak(cfg: JobConfig) -> int:
    """Peak tensor bytes of the second training step (the first creates the optimizer state)."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    optimizer = OptimizersContainer([model], cfg.optimizer, torch.device("cpu"))
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1))

    def step():
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return int(np.asarray(sizes).sum(axis=1).max())


@pytest.mark.parametrize(
    "mode, option", [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]
)
def test_estimate_within_15_percent_of_measured_peak(mode, option):
    cfg = config(mode, option)
    predicted = estimate_memory(ARGS, cfg, 1, torch.float32).peak_tensors
    measured = measured_peak(cfg)
    print(
        f"{mode}/{option}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    )
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured)
