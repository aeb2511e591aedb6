"""Every parallel layout trains the same model to the same losses (issue: parallelism parity).

All runs start from one seed checkpoint, use the same global batch of 8 samples × 64 tokens,
fp32 and deterministic mode; the losses of steps 1-5 must equal the 1-process reference's within
1e-5. The model is `debugmodel_deep` (8 thin layers) so 4-rank interleaved pipelines have a
layer per stage.
"""


import pytest

from conftest import read_metrics

STEPS = 5
GLOBAL_BATCH = 8
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]
COMMON = ["--model.flavor", "debugmodel_deep", "--training.steps", str(STEPS),
          "--training.global_batch_size", str(GLOBAL_BATCH), "--checkpoint.export_at_end", "false",
          "--checkpoint.interval", "1000"]


def pp(degree: int, schedule: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", str(degree),
            "--parallelism.pipeline_parallel_schedule", schedule]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]

# id: (processes, local batch size, extra options)
LAYOUTS = {
    "fsdp4": (4, 2, []),
    "hsdp2x2": (4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "ddp2": (2, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2": (2, 8, TP2),
    "tp2_no_loss_parallel": (2, 8, TP2 + ["--parallelism.disable_loss_parallel", "true"]),
    "fsdp2_tp2": (4, 4, TP2),
    "fsdp2_cpu_offload": (2, 4, ["--training.enable_cpu_offload", "true"]),
    **{f"pp2_{s}": (2, 8, pp(2, s)) for s in SCHEDULES},
    # 4 stages: the multi-stage schedules and LoopedBFS (GPipe and 1F1B are covered by pp2).
    **{f"pp4_{s}": (4, 8, pp(4, s)) for s in SCHEDULES if s not in ("GPipe", "1F1B")},
    **{f"pp2_fsdp2_{s}": (4, 4, pp(2, s)) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")},
    "pp2_tp2": (4, 8, pp(2, "1F1B") + TP2),
    "grad_accum_4x1": (1, 2, []),  # 4 accumulation steps of 2 samples on one process
}


@pytest.fixture(scope="module")
def seed_and_reference(tiny_dataset, tmp_path_factory):
    """(seed checkpoint folder, reference losses of 1 process × 8 samples from it)."""
    from conftest import TINY, launch

    root = tmp_path_factory.mktemp("parity")
    base = TINY + ["--data.dataset_path", tiny_dataset, *COMMON]
    launch(1, base + ["--job.dump_folder", str(root / "seed"),
                      "--checkpoint.create_seed_checkpoint", "true"]).check()
    seed = str(root / "seed" / "checkpoint" / "step-0")
    launch(1, base + ["--job.dump_folder", str(root / "ref"), "--training.local_batch_size", "8",
                      "--checkpoint.initial_load_path", seed]).check()
    return seed, read_metrics(str(root / "ref"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, seed_and_reference, train, tmp_path):
    seed, reference = seed_and_reference
    nproc, local_batch, extra = LAYOUTS[layout]
    dump = str(tmp_path / layout)
    run = train(nproc, *COMMON, "--training.local_batch_size", str(local_batch),
                "--checkpoint.initial_load_path", seed, *extra, dump=dump).check()
    assert "model only" in run.stdout  # it started from the seed checkpoint
    losses = read_metrics(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    diffs = [abs(losses[s] - reference[s]) for s in range(1, STEPS + 1)]
    assert max(diffs) <= 1e-5, (layout, diffs)
    assert reference[STEPS] < reference[1]  # and the reference itself trains
