"""run_train.sh (the user's entry point) trains the debug model under composed layouts.

Loss parity of every layout is in test_parallel_parity.py (through torchrun directly); these
check that the shell entry point passes the layout through, on the two most composed ones."""

import os
import subprocess

import pytest

from conftest import REPO, SHALLOW
from titanlab.metrics import parse_log_line

LAYOUTS = {
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2"],
    "pp_tp": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
}
EXPECTED = {
    "hsdp": "ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, world_size=4, ep=1)",
    "pp_tp": "ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=2, world_size=4, ep=1)",
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_run_train_sh_layout(layout, tiny_dataset, tmp_path):
    env = dict(os.environ, NGPU="4", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            os.path.join(REPO, "run_train.sh"),
            "train_configs/debug_model.toml",
            "--training.steps",
            "3",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--metrics.log_freq",
            "1",
            "--validation.enable",
            "false",
            "--checkpoint.enable",
            "false",
            "--data.dataset_path",
            tiny_dataset,
            "--job.dump_folder",
            str(tmp_path / "out"),
            *SHALLOW,  # what the entry point passes through does not depend on the depth
            *LAYOUTS[layout],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = dict(filter(None, map(parse_log_line, proc.stdout.splitlines())))
    assert sorted(losses) == [1, 2, 3]
    assert f"layout: {EXPECTED[layout]}" in proc.stdout
    assert all(0 < v < 20 for v in losses.values())
