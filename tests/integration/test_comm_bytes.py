"""The communication of one real training step equals the closed-form prediction exactly.

Runs the trainer on warm ranks with `TITANLAB_COMM_COUNT` set (tools/comm_bytes.py) for three
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


def assert_measured_equals_predicted(lay, measured) -> None:
    args = comm_bytes.model_args()
    assert len(measured) == lay.nproc
    for rank, kinds in enumerate(measured):
        predicted = comm_bytes.histogram(comm_bytes.predict(lay, args, rank))
        assert {k: v["sizes"] for k, v in kinds.items()} == predicted, f"rank {rank}"
        for kind, terms in predicted.items():
            nbytes = sum(int(size.split("x")[0]) * calls for size, calls in terms.items())
            assert kinds[kind]["bytes"] == nbytes
            assert kinds[kind]["calls"] == sum(terms.values())


@pytest.mark.parametrize("name", ["FSDP 2", "TP 2", "CP 2 (allgather)"])
def test_measured_equals_predicted(name, tiny_dataset, tmp_path):
    lay = LAYOUTS[name]
    assert_measured_equals_predicted(lay, comm_bytes.measure(lay, tiny_dataset, str(tmp_path)))


def test_each_zero_stage_sends_what_the_paper_says_and_trains_like_one_process(
    tiny_dataset, tmp_path
):
    """`parallelism.zero_stage` 0-3 on 2 data-parallel ranks with 2 microbatches per step:
    every collective as predicted (tools/lib/comm_predict.py), the gradient and parameter
    traffic per step against ZeRO's volumes (Rajbhandari et al. 2020, §7; Ψ the parameter
    bytes, counted as a bandwidth-optimal ring sends them), and the losses of 1 process (the
    same 8 samples a step) within 1e-5."""
    one = comm_bytes.Layout("1 process", 1, grad_accum=4)
    comm_bytes.measure(one, tiny_dataset, str(tmp_path))
    want = comm_bytes.losses(one, str(tmp_path))
    psi = comm_bytes.param_bytes(comm_bytes.model_args())
    volumes = {}
    for stage in (0, 1, 2, 3):
        lay = LAYOUTS[f"ZeRO-{stage}, dp 2, grad accum 2"]
        measured = comm_bytes.measure(lay, tiny_dataset, str(tmp_path))
        assert_measured_equals_predicted(lay, measured)
        got = comm_bytes.losses(lay, str(tmp_path))
        assert sorted(got) == sorted(want) == [1, 2]
        assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, (stage, got, want)
        volumes[stage] = comm_bytes.parameter_traffic(measured[0]) / psi
    print(f"\nparameter and gradient traffic per step, in Ψ ({psi} bytes), 2 microbatches: "
          + ", ".join(f"ZeRO-{s} {v:.2f}" for s, v in volumes.items()))  # fmt: skip
    # Per microbatch ZeRO-3 gathers twice (the root unit once) and reduce-scatters once; 2
    # and 1 gather once per step, 2 reduce-scatters per microbatch, 1 once; DDP all-reduces
    # once (2Ψ as a ring sends it).
    assert volumes[0] == pytest.approx(2.0, rel=1e-3)
    assert volumes[1] == pytest.approx(2.0, rel=0.01)
    assert volumes[2] == pytest.approx(3.0, rel=0.01)
    root = comm_bytes.param_bytes(comm_bytes.model_args(), ("norm", "output")) / psi
    assert volumes[3] == pytest.approx(6.0 - 2 * root, rel=0.01)  # the root: no 2nd gather
