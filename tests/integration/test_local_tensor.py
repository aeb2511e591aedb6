"""comm.mode local_tensor: every rank in one process, against the same layout on real ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO, TINY, read_metrics

STEPS = ["--training.steps", "4", "--checkpoint.enable", "false"]
PLAIN_LOSS = ["--loss.fused_linear_cross_entropy", "false"]


def local_tensor_run(
    tmp_path, tiny_dataset, *overrides: str, ranks: int = 2
) -> subprocess.CompletedProcess:
    """`python -m titanlab.train --comm.mode local_tensor` on `ranks` simulated ranks."""
    args = [*TINY, "--data.dataset_path", tiny_dataset, "--job.dump_folder",
            str(tmp_path / "local"), "--comm.mode", "local_tensor", *STEPS, *overrides]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU=str(ranks))
    return subprocess.run([sys.executable, "-m", "titanlab.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_tensor_parallel_2_losses_equal_the_two_process_run(train, tiny_dataset, tmp_path):
    layout = ["--parallelism.tensor_parallel_degree", "2", *PLAIN_LOSS]
    real_dump = str(tmp_path / "real")
    train(2, *STEPS, *layout, dump=real_dump).check()
    local = local_tensor_run(tmp_path, tiny_dataset, *layout)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    real, simulated = read_metrics(real_dump), read_metrics(str(tmp_path / "local"))
    assert sorted(real) == sorted(simulated) == [1, 2, 3, 4]
    for step in real:
        assert simulated[step] == pytest.approx(real[step], abs=1e-6), step


@pytest.mark.parametrize(
    ("ranks", "layout", "says"),
    [
        (2, ["--parallelism.data_parallel_shard_degree", "2"], "does not simulate data parallel"),
        (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree",
             "2"], "does not simulate data parallel"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--loss.fused_linear_cross_entropy",
             "true", "--loss.chunk_size", "64"], "the fused loss under tensor parallel"),
        (9, ["--parallelism.tensor_parallel_degree", "9"], "simulates 2..8 ranks"),
    ],
)  # fmt: skip
def test_what_local_tensors_cannot_simulate_is_one_line(
    tiny_dataset, tmp_path, ranks, layout, says
):
    """FSDP 2 and FSDP 2 × TP 2: FSDP2 resizes parameter storages, which torch 2.13's local
    tensors refuse; TP 2 with the fused loss: its per-rank vocabulary offset."""
    out = local_tensor_run(tmp_path, tiny_dataset, *layout, ranks=ranks)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("titanlab: error: comm.mode=local_tensor") and says in last
    assert "Traceback" not in out.stdout + out.stderr
