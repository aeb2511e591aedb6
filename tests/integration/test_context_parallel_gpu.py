"""Context parallel on GPUs: CP 2 trains to the same losses as one GPU (skipped without 2 GPUs).

On CPU, context parallel runs through `titanlab.distributed.context_parallel.cpu`; its layouts are
part of the generated parity matrix (tests/integration/test_parallel_parity.py) and its ring
attention is checked op by op in tests/unit/distributed/context_parallel/test_cpu.py.
"""

import pytest
import torch

from conftest import read_metrics

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="context parallel needs 2 CUDA GPUs"
)


@needs_two_gpus
def test_cp2_matches_one_gpu(train, tmp_path):
    common = [
        "--training.steps",
        "5",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--checkpoint.enable",
        "false",
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train(1, *common, dump=one).check()
    train(2, *common, "--parallelism.context_parallel_degree", "2", dump=two).check()
    a, b = read_metrics(one), read_metrics(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    # Flash/efficient attention kernels differ in summation order from the single-GPU run.
    assert max(abs(a[s] - b[s]) for s in a) < 1e-3
