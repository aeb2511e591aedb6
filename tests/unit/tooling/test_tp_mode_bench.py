"""The tensor-parallel mode table (`tools/benchmark.py --matrix tp`): at the same degree, 1D and
2D train like one process (and so like each other), and one block's communication per kind
equals each mode's closed form. CI runs degree 4 (1D and 2D on 4 ranks); `make
test-parity-full` adds degree 8 (1D, 2.5D with d = 2 and 3D)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools.lib import tp_mode_bench  # noqa: E402
from tools.lib.tp_mode_bench import BATCH, SEQ, Mode  # noqa: E402

FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)


@pytest.mark.parametrize("degree", [4, pytest.param(8, marks=FULL_ONLY)], ids=["tp4", "tp8"])
def test_modes_at_one_degree_train_alike_and_send_their_closed_form(degree):
    modes = [m for m in tp_mode_bench.MODES if m.tp == degree]
    results = {m: tp_mode_bench.measure(m) for m in modes}
    for mode, r in results.items():
        want, got = r["loss"]
        assert abs(got - want) / (BATCH * SEQ) < 1e-6 and r["worst_grad"] < 1e-5, (mode, r)
        assert tp_mode_bench.as_predicted(mode, r), (
            mode,
            r["block"],
            tp_mode_bench.predicted(mode),
        )
    one_d = results[Mode("1d", degree)]["loss"][1]
    assert all(abs(r["loss"][1] - one_d) / (BATCH * SEQ) < 1e-6 for r in results.values())
    table = tp_mode_bench.table(results)
    assert table.count("| equal |") == len(modes) and "| 1.00 |" in table  # 1D against itself


def test_closed_forms_scale_as_each_method_says():
    one_d = tp_mode_bench.predicted(Mode("1d", 4))
    assert one_d == tp_mode_bench.predicted(Mode("1d", 8))  # activations, whatever the degree
    two_d, deep = (
        tp_mode_bench.predicted(Mode("2d", 4)),
        tp_mode_bench.predicted(Mode("2.5d", 8, 2)),
    )
    # 2.5D splits the rows d ways more: fewer activation bytes, the weights' all-reduce added
    assert deep["all_gather"] < two_d["all_gather"] and deep["all_reduce"] > two_d["all_reduce"]
