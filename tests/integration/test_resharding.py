"""A checkpoint saved under FSDP 4 resumes under other layouts and continues the same losses.

The uninterrupted run is FSDP 4 (ZeRO stage 3) for 6 steps. Its step-3 checkpoint (model,
optimizer, LR schedule, data position) is then loaded under FSDP 2 × TP 2 at ZeRO stage 1,
PP 2 × FSDP 2 at stage 2, DDP on 4 ranks (stage 0: nothing sharded) and one process, each of
which trains steps 4-6; their losses must equal the uninterrupted run's within 1e-5.
DCP reshards the model and optimizer state, and the sampler converts the data position to
the new number of data-parallel ranks.
"""

import os

import pytest

from conftest import read_metrics

COMMON = [
    "--model.flavor",
    "debugmodel_deep",
    "--training.steps",
    "6",
    "--training.global_batch_size",
    "8",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.export_at_end",
    "false",
]
ZERO = "--parallelism.zero_stage"
TARGETS = {
    "fsdp2_tp2_zero1": (4, 4, ["--parallelism.tensor_parallel_degree", "2", ZERO, "1"]),
    "pp2_fsdp2_zero2": (4, 4, ["--parallelism.pipeline_parallel_degree", "2", ZERO, "2"]),
    "ddp4_zero0": (4, 2, [ZERO, "0"]),
    "single_process": (1, 8, []),
}


@pytest.fixture(scope="module")
def fsdp4_run(tiny_dataset, tmp_path_factory):
    from conftest import TINY, launch

    dump = str(tmp_path_factory.mktemp("reshard") / "fsdp4")
    launch(
        4,
        TINY
        + [
            "--data.dataset_path",
            tiny_dataset,
            *COMMON,
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            dump,
        ],
    ).check()
    return dump


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsdp4_checkpoint_resumes_under(target, fsdp4_run, train, tmp_path):
    nproc, local_batch, extra = TARGETS[target]
    step3 = os.path.join(fsdp4_run, "checkpoint", "step-3")
    dump = str(tmp_path / target)
    run = train(
        nproc,
        *COMMON,
        "--training.local_batch_size",
        str(local_batch),
        *extra,
        "--checkpoint.initial_load_path",
        step3,
        "--checkpoint.initial_load_model_only",
        "false",
        dump=dump,
    ).check()
    assert "(step 3)" in run.stdout  # resumed with the full training state, not just weights
    want, got = read_metrics(fsdp4_run), read_metrics(dump)
    assert sorted(got) == [4, 5, 6]
    diffs = [abs(got[s] - want[s]) for s in (4, 5, 6)]
    assert max(diffs) <= 1e-5, diffs
