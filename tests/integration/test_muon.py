"""Muon on every kind of layout trains as one process does; a resumed Muon run is bitwise the
straight one (its momentum buffers are DTensors in the checkpoint)."""

import os

import pytest

from conftest import CONSTANT_LR, checkpoint_every, read_metrics

# float32 Newton-Schulz: bfloat16's (torch's default) turns the last-bit differences of another
# reduction order into 1e-5 loss differences within 4 steps (TP 2: 1.7e-5 at step 4)
MUON = ["--optimizer.name", "Muon", "--optimizer.lr", "0.01", "--training.steps", "4",
        "--training.global_batch_size", "4", "--checkpoint.enable", "false",
        "--optimizer.muon_ns_dtype", "float32"]  # fmt: skip
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
LAYOUTS = {
    "fsdp2": (2, [], []),
    "tp2": (2, [], ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, [], ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_microbatch_size", "1"]),
    "ddp2": (2, [], ["--parallelism.zero_stage", "0"]),
    "ep2_fsdp2": (2, MOE, ["--parallelism.expert_parallel_degree", "2"]),
}  # fmt: skip
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_process(tiny_dataset, tmp_path_factory):
    """Losses of the 1-process Muon run, per model (dense, MoE)."""
    from conftest import TINY, launch

    out = {}
    # The load-balance loss is a statistic of each global microbatch: the MoE reference takes
    # the 2 ranks' 2 + 2 samples as one microbatch of 4 (tests/integration/test_qwen3_moe.py)
    for name, model in (("dense", []), ("moe", [*MOE, "--training.local_batch_size", "4"])):
        dump = str(tmp_path_factory.mktemp(f"muon_{name}"))
        args = [*TINY, "--data.dataset_path", tiny_dataset, "--job.dump_folder", dump, *MUON,
                *model]  # fmt: skip
        launch(1, args).check()
        out[name] = read_metrics(dump)
    return out


FULL_ONLY = ("pp2", "ddp2")  # CI: FSDP, TP and EP × FSDP; `make test-parity-full` all of them


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=pytest.mark.skipif(
                os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full"
            ),
        )
        if n in FULL_ONLY
        else n
        for n in LAYOUTS
    ],
)
def test_muon_layout_matches_one_process(name, one_process, train, tmp_path):
    ranks, model, layout = LAYOUTS[name]
    dump = str(tmp_path / name)
    result = train(ranks, *MUON, *model, *layout, dump=dump).check()
    want = one_process["moe" if model else "dense"]
    got = read_metrics(dump)
    assert sorted(got) == [1, 2, 3, 4], result.stdout[-2000:]
    for step in got:
        assert abs(got[step] - want[step]) <= TOLERANCE, (name, step, got[step], want[step])
    assert want[4] < want[1]  # Muon trains


def test_muon_resume_is_bitwise_exact(train, tmp_path):
    ckpt = checkpoint_every(3, "--checkpoint.keep_latest_k", "0")
    args = [*MUON[:4], *CONSTANT_LR, *ckpt]  # bfloat16 Newton-Schulz: bitwise all the same
    straight = str(tmp_path / "straight")
    train(2, *args, "--training.steps", "6", dump=straight).check()
    resumed = str(tmp_path / "resumed")
    train(2, *args, "--training.steps", "3", dump=resumed).check()
    second = train(2, *args, "--training.steps", "6", dump=resumed).check()
    assert "step-3" in second.stdout and sorted(second.losses) == [4, 5, 6]
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]  # bitwise
