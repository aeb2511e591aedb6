"""The communication of one real training step equals the closed-form prediction exactly.

Runs the trainer under torchrun with `TITANLAB_COMM_COUNT` set (tools/comm_bytes.py) for three
cheap layouts (FSDP, TP, and context parallel's ring) and compares, per rank and per collective kind, every call's size and group
against `predict`. The comparison is exact, not approximate: the counts are of tensor sizes,
which are deterministic, so any difference is a change in what the parallelisms communicate
(and the formulas in docs/parallelism.md must be updated with it).
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, REPO)
from tools import comm_bytes

LAYOUTS = {lay.name: lay for lay in comm_bytes.LAYOUTS}


@pytest.mark.parametrize("name", ["FSDP 2", "TP 2", "CP 2 (allgather)"])
def test_measured_equals_predicted(name, tiny_dataset, tmp_path):
    lay = LAYOUTS[name]
    measured = comm_bytes.measure(lay, tiny_dataset, str(tmp_path))
    args = comm_bytes.model_args()
    assert len(measured) == lay.nproc
    for rank, kinds in enumerate(measured):
        predicted = comm_bytes.histogram(comm_bytes.predict(lay, args, rank))
        assert {k: v["sizes"] for k, v in kinds.items()} == predicted, f"rank {rank}"
        for kind, terms in predicted.items():
            nbytes = sum(int(size.split("x")[0]) * calls for size, calls in terms.items())
            assert kinds[kind]["bytes"] == nbytes
            assert kinds[kind]["calls"] == sum(terms.values())
