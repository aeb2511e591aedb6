"""The ledger of a training loop other than titanlab's `Trainer`: the plain PyTorch loop the
trainer is measured against (gate 3), or a peer's step (torchtitan's, gate 4), recorded by
`step.record_loop` and priced exactly as `build_ledger` records and prices the trainer's, on
the target GPU's code path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titanlab.config.device_path import Target
from titanlab.ledger.price import price
from titanlab.ledger.run import Ledger
from titanlab.ledger.step import record_loop
from titanlab.planning.cluster import get_profile


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
