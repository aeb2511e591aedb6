"""The planner counts the data-parallel collectives the trainer issues.

`tools/lib/comm_predict.py` lists every collective of a training step in closed form, and
tests/integration/test_comm_bytes.py checks it call for call against the comm counter in real
runs (FSDP, HSDP, PP × FSDP, ZeRO 0-3 with accumulation). The planner's per-unit counts
(`comm_model.fsdp_calls`, DDP's all-reduces) must agree with it on every such layout of
`comm_predict.LAYOUTS` that has data parallel, for the busiest pipeline rank (the last).
"""

from __future__ import annotations

import pytest

from titanlab.planning.cluster import PROFILES
from titanlab.planning.comm_model import fsdp_calls
from titanlab.planning.layouts import Layout
from titanlab.planning.perf_model import ModelShape, Run, _work, predict
from tools.lib import comm_predict

H100 = PROFILES["h100"]
DATA_PARALLEL = [lay for lay in comm_predict.LAYOUTS if lay.dp_replicate * lay.dp_shard > 1]


def _measured_counts(lay) -> dict[str, int]:
    """Calls per kind of the data-parallel terms the exact predictor lists for the last rank."""
    terms = comm_predict.predict(lay, comm_predict.model_args(), lay.nproc - 1)
    out: dict[str, int] = {}
    for t in terms:
        if t.what.startswith(("FSDP", "DDP", "HSDP")):
            out[t.kind] = out.get(t.kind, 0) + t.calls
    return out


@pytest.mark.parametrize("lay", DATA_PARALLEL, ids=lambda lay: lay.name)
def test_the_planners_data_parallel_calls_are_the_trainers(lay):
    args = comm_predict.model_args()
    shape = ModelShape.of(args)
    dp = lay.dp_replicate * lay.dp_shard
    run = Run(
        seq_len=comm_predict.SEQ,
        global_batch=comm_predict.LOCAL_BS * dp * lay.grad_accum,
        param_bytes=4,
        dtype="float32",
        pp_microbatch_size=comm_predict.MICROBATCH,
    )
    plan = Layout(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp,
                  "1F1B" if lay.pp > 1 else None, lay.grad_accum, cp=lay.cp,
                  zero_stage=lay.zero_stage)  # fmt: skip
    work = _work(shape, run, plan)
    assert work.has_head  # the last pipeline rank is the busiest
    want = _measured_counts(lay)
    gathers, reduces = fsdp_calls(plan, run, work)
    assert gathers == want.get("all_gather", 0)
    assert reduces == want.get("reduce_scatter", 0)
    comm = predict(shape, run, plan, H100).comm
    all_reduce = sum(c.calls for c in comm if c.kind == "all-reduce")
    assert all_reduce == want.get("all_reduce", 0)
