"""A run holds no more Python objects at step 120 than at step 20: nothing titanlab runs each step
(the loop, logging, validation, checkpointing, AdamW over plain tensors and, under FSDP, over
DTensors) keeps an object per step. One object leaked per step grows the counts by 100 or more;
torchtitan's #3790 (fused AdamW over FSDP2's DTensor parameters kept one DTensorSpec per
parameter per step, pytorch#188174, fixed before torch 2.13) would grow them by ~2,000 here.
`tools/benchmark_host_memory.py` measures the same and the resident size over thousands of steps.

Rank 0 samples itself after steps 20 and 120 (`host_memory_runs`): the objects the cyclic
collector tracks, counted by type without a collection (the loop runs `gc.collect(1)` every
`training.gc_freq` steps and never a full one, so garbage that reached the oldest generation
counts too); then, after a full collection, the items the live lists, dicts, sets and deques
hold, which see a history that keeps an untracked float or int per step. Both samples follow
the same events: a log line, a validation, a checkpoint and the loop's collection. (pymalloc's
live blocks are no bound here: they move by 100 to 350 between the two samples of a
fault-free run with the checkpoint writer's buffers in flight.)
"""

import os

import pytest

from conftest import TINY
from tools.lib import host_memory as hm

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_OBJECTS = 10
"""Tracked objects the two counts may differ by (the samples' own left out): 0 in these runs,
against +100 for one object leaked per step."""
MAX_ITEMS = 20
"""Container items the two samples may differ by: 0 in these runs, against +100 for one item
appended per step."""


@pytest.mark.parametrize(
    "nproc,layout",
    [(1, []), (2, ["--parallelism.data_parallel_shard_degree", "2"])],
    ids=["1 process", "FSDP 2"],
)
def test_a_run_keeps_no_python_object_per_step(nproc, layout, tmp_path, tiny_dataset):
    from tools.lib.rank_pool import default_pool

    out = str(tmp_path / "samples.json")
    args = [out, *TINY, "--data.dataset_path", tiny_dataset, "--job.dump_folder",
            str(tmp_path / "dump"), "--model.flavor", "debugmodel_tiny",
            "--optimizer.implementation", "fused", "--metrics.log_freq", "10",
            "--training.gc_freq", "10", "--checkpoint.enable", "true",
            "--checkpoint.interval", "20", "--checkpoint.keep_latest_k", "2",
            "--checkpoint.export_at_end", "false", "--validation.enable", "true",
            "--validation.freq", "20", "--validation.steps", "1", *layout]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = default_pool().run(nproc, args, env=env, timeout=300,
                              target="host_memory_runs:pool_main", paths=[HERE])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (first, last), record = hm.read_samples(out)
    assert (first.step, last.step) == (20, 120)
    assert last.objects - first.objects <= MAX_OBJECTS, (
        f"{last.objects - first.objects} more tracked objects at step 120 than at step 20; "
        f"most grown: {record['top']}"
    )
    assert last.items - first.items <= MAX_ITEMS, (
        f"{last.items - first.items} more items in lists, dicts, sets and deques at step 120 "
        "than at step 20"
    )
