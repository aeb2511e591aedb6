"""`training.skip_nonfinite_steps`: a step whose loss or global gradient norm is not finite is
not applied on any rank, one warning names it, a finite step resets the count, and one step too
many in a row ends the run with one line (exit 3), on each kind of layout; under float16 the
loss scaler's overflows are not counted.

The faults are injected inside the ranks (`nonfinite_runs.py`, on warm ranks): a NaN forward
on every rank (loss and gradients NaN) and a NaN in one element of rank 0's own gradient shard
(the loss finite: only the all-reduced norm tells the other ranks). The layouts are generated:
for each family the smallest 2-rank layout the trainer's validator accepts
(`tools/parity_matrix.valid_layouts`), the dense debug model for FSDP, TP and PP, Qwen3-MoE's
for EP.
"""

import json
import math
import os

import pytest

from conftest import REPO, THIN, TINY_RUN, RunResult
from titanlab.metrics import parse_log_line
from tools import parity_matrix

HERE = os.path.join(REPO, "tests", "integration")
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
FAMILIES = {
    "fsdp": ({"fsdp"}, THIN),
    "tp": ({"tp"}, THIN),
    "pp": ({"pp:1F1B"}, THIN),
    "ep": ({"ep", "fsdp"}, MOE),  # the experts' ranks taken from FSDP's
}
"""family → (the features its layout must have, the model's options)."""
FAULTS = "3:loss,5:grad,6:loss"
"""Step 3 skipped, step 4 trains (the count starts again), 5 skipped, 6 the second in a row."""
STOP = (
    "titanlab: error: step 6: loss or grad norm non-finite for 2 consecutive steps (5-6; "
    "training.skip_nonfinite_steps=1): loss nan, grad norm nan, stopped before its update; "
    "last complete checkpoint: none (lower optimizer.lr or check the data)"
)


def smallest_layout(family: str) -> parity_matrix.Layout:
    features, model = FAMILIES[family]
    pool = parity_matrix.valid_layouts(
        (2,), model, with_ep=family == "ep", schedules=("1F1B",), grad_accum=(1,)
    )
    return min((lay for lay in pool if features <= lay.features), key=lambda lay: len(lay.features))


def run(tmp_path, dataset: str, faults: str, *options: str) -> tuple[RunResult, list[list[dict]]]:
    """2 warm ranks of `nonfinite_runs.pool_main`; (the run, each rank's step records)."""
    from tools.lib.rank_pool import default_pool

    out = str(tmp_path / "records")
    args = [out, faults, *TINY_RUN, "--data.dataset_path", dataset, "--job.dump_folder",
            str(tmp_path / "dump"), "--checkpoint.enable", "false", *options]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = default_pool().run(2, args, env=env, timeout=300, target="nonfinite_runs:pool_main",
                              paths=[HERE])  # fmt: skip
    result = RunResult(proc.returncode, proc.stdout, proc.stderr)
    for line in proc.stdout.splitlines():
        if parsed := parse_log_line(line):
            result.losses[parsed[0]] = parsed[1]
    records = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.jsonl"), encoding="utf-8") as f:
            records.append([json.loads(line) for line in f])
    return result, records


def skip_warnings(stdout: str) -> list[str]:
    return [ln.split("WARNING ")[1] for ln in stdout.splitlines() if " skipped: loss " in ln]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_non_finite_steps_are_skipped_on_every_rank_then_stop_the_run(
    family, tmp_path, tiny_dataset
):
    layout = smallest_layout(family)
    result, records = run(
        tmp_path, tiny_dataset, FAULTS, *FAMILIES[family][1],
        *layout.overrides(4), "--training.steps", "6",
        "--training.skip_nonfinite_steps", "1",
    )  # fmt: skip
    log = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 3, (layout.name, log)
    # every rank stopped at step 6 with the same one line, the last it wrote
    for rank in range(2):
        assert f"rank {rank} last line: {STOP}\n" in result.stderr, (layout.name, rank, log)
    assert "Traceback" not in result.stderr, log
    # rank 0 warned once for each skipped step (the injected grad NaN leaves the loss finite)
    warned = skip_warnings(result.stdout)
    assert [w.split(" skipped")[0] for w in warned] == ["step 3", "step 5"], warned
    assert warned[0].startswith("step 3 skipped: loss nan, grad norm nan (non-finite step 1 ")
    loss_5 = float(warned[1].split("loss ")[1].split(",")[0])
    assert abs(loss_5 - result.losses[5]) < 1e-4 and "grad norm nan (" in warned[1], warned
    assert math.isnan(result.losses[3]) and math.isfinite(result.losses[5])
    for s in (1, 2, 4):
        assert math.isfinite(result.losses[s]), (s, result.losses)
    for rank, steps in enumerate(records):
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5], (rank, steps)
        assert [r["step"] for r in steps if r["skipped"]] == [3, 5]
        state = {r["step"]: r["state"] for r in steps}
        # a skipped step leaves every shard of the weights and optimizer state as it was ...
        assert state[3] == state[2] and state[5] == state[4], (layout.name, rank)
        # ... and the steps around it are applied
        assert len({state[1], state[2], state[4]}) == 3, (layout.name, rank)


def test_float16_overflows_are_the_scalers_and_a_nan_loss_is_still_skipped(tmp_path, tiny_dataset):
    # 2^22 overflows float16's gradients for the first steps: the loss scaler skips them and
    # halves its scale (test_mixed_precision.py). With skip_nonfinite_steps=1, two of those in a
    # row would stop the run if they were counted. The NaN forward of step 7 is counted, and
    # the loop, which logs steps 4 and 8 only, does not take its NaN loss for divergence.
    result, records = run(
        tmp_path, tiny_dataset, "7:loss", *THIN, "--training.mixed_precision_on_cpu", "true",
        "--training.mixed_precision_param", "float16", "--training.loss_scale_init",
        str(2.0**22), "--training.local_batch_size", "2", "--training.steps", "8",
        "--training.skip_nonfinite_steps", "1", "--metrics.log_freq", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    overflowed = [
        int(line.split("step ")[1].split()[0])
        for line in result.stdout.splitlines()
        if "skipped: float16 gradients overflowed" in line
    ]
    assert overflowed[:2] == [1, 2] and 7 not in overflowed, overflowed
    assert [w.split(" skipped")[0] for w in skip_warnings(result.stdout)] == ["step 7"]
    for rank, steps in enumerate(records):
        assert [r["step"] for r in steps] == list(range(1, 9)), (rank, steps)
        assert [r["step"] for r in steps if r["skipped"]] == [7]
        state = {r["step"]: r["state"] for r in steps}
        assert state[7] == state[6] and state[8] != state[7], rank  # step 8 trains after it
    assert sorted(result.losses) == [1, 4, 8] and math.isfinite(result.losses[8])
