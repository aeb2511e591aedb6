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
    """`record_loop` on the cluster profile `device`, priced: a loop training `tokens` tokens a
    step at `flops_per_token` model FLOPs each. A `build` with a `group_dims()` method names
    its process groups by mesh dim (which collectives overlap the compute); else its groups,
    if any, wait."""
    profile = get_profile(device)
    ops = record_loop(build, Target(profile.device_type, profile.compute_capability))
    dims = build.group_dims() if hasattr(build, "group_dims") else {}
    return Ledger(ops, price(ops, profile, dims), profile, tokens, flops_per_token * tokens,
                  summary, 0.0, seq_len, 1, dims)  # fmt: skip
