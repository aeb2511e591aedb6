"""The ZeRO stage table's parts that need no training run: the rows, the prediction's order
between stages, the measured peak it reads and the table it renders."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools.lib import zero_bench  # noqa: E402


def test_every_stage_has_its_measured_layout():
    assert [s for s, _ in zero_bench.STAGES] == [0, 1, 2, 3, 2, 3]
    for stage, _ in zero_bench.STAGES:
        lay = zero_bench.layout(stage)
        assert lay.zero_stage == stage and lay.nproc == 2 and lay.grad_accum == 2


def test_prediction_falls_with_each_stage_and_offload_changes_nothing_on_cpu(tmp_path):
    predicted = {s: zero_bench.predicted_bytes(s, False, str(tmp_path)) for s in (0, 1, 2, 3)}
    mib = 2**20
    # 0 holds everything (and replicate's gathered copy); 1 shards AdamW state; 2 also the
    # gradients; 3 also the weights between uses.
    assert predicted[0] > predicted[1] > predicted[2] > predicted[3]
    assert round(predicted[0] / mib, 2) == 30.17  # the measured peak: 30.18 (docs/performance.md)
    assert zero_bench.predicted_bytes(3, True, str(tmp_path)) == predicted[3]


def test_reads_the_peak_of_every_live_tensor_and_renders_a_row(tmp_path):
    folder = tmp_path / "memory_snapshot"
    folder.mkdir()
    (folder / "rank1_step2_peak.json").write_text(json.dumps({"peak_live_bytes": 123}))
    assert zero_bench.measured_peak(str(tmp_path), rank=1) == 123
    row = zero_bench.StageRow(
        2, True, 105 * 2**20, 100 * 2**20, 10, True, 3.0, 0.125, 98 * 2**20, 99 * 2**20
    )
    table = zero_bench.render([row])
    assert (
        "| ZeRO-2 + offload | 105.00 | 100.00 [98.00, 99.00] | +5.0% | 10 | yes | 3.00 Ψ | 125 |"
        in table
    )
