"""The ledger of a training loop other than titanlab's `Trainer`: the plain PyTorch loop the
trainer is measured against (gate 3), or a peer's step (torchtitan's, gate 4), recorded and
priced exactly as `build_ledger` records and prices the trainer's, on the target GPU's code
path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from titanlab.config.device_path import Target, code_path_of
from titanlab.ledger.gpu_kernels import gpu_attention
from titanlab.ledger.price import price
from titanlab.ledger.record import OpRecord, Recorder
from titanlab.ledger.run import Ledger
from titanlab.planning.cluster import get_profile


def record_loop(build: Callable[[], Callable[[], Any]], target: Target) -> list[OpRecord]:
    """The ops of one step of a loop on `target`'s code path. `build()` runs under
    `FakeTensorMode` (the model, optimizer and batch it makes are fake tensors: build them on
    the CPU) and returns the step; the step runs twice and the second is recorded (the first
    builds the optimizer state). Compiled modules run eagerly, as in the trainer's ledger."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = gpu_attention(target) if target.type == "cuda" else contextlib.nullcontext()
    recorder = Recorder()
    with (
        code_path_of(target),
        attention,
        torch.compiler.set_stance("force_eager"),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        step = build()
        step()
        with recorder:
            step()
    return recorder.ops


def ledger_of_loop(
    build: Callable[[], Callable[[], Any]],
    device: str,
    tokens: int,
    flops_per_token: float,
    summary: str,
    seq_len: int,
) -> Ledger:
    """`record_loop` on the cluster profile `device`, priced: a one-device loop (no
    collectives) training `tokens` tokens a step at `flops_per_token` model FLOPs each."""
    profile = get_profile(device)
    ops = record_loop(build, Target(profile.device_type, profile.compute_capability))
    return Ledger(ops, price(ops, profile), profile, tokens, flops_per_token * tokens, summary,
                  0.0, seq_len)  # fmt: skip
