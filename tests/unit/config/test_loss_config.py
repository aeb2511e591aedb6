"""Bad `[loss]` input: one line naming the value (and the other option) and what would be valid."""

from __future__ import annotations

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config

FUSED = ["--loss.fused_linear_cross_entropy", "true"]
CASES = {
    "chunk 0": (["--loss.chunk_size", "0"], "loss.chunk_size=0 must be >= 1"),
    "chunk over a microbatch": (
        [
            "--loss.chunk_size",
            "5000",
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "2048",
        ],
        "loss.chunk_size=5000 is larger than a microbatch (training.local_batch_size × seq_len "
        "= 4096 tokens); use 1 .. 4096",
    ),
    "distill under pp": (
        ["--distill.teacher_path", "/t", "--parallelism.pipeline_parallel_degree", "2"],
        "with distill.teacher_path and parallelism.pipeline_parallel_degree=2 is not supported",
    ),
    "distill under tp": (
        ["--distill.teacher_path", "/t", "--parallelism.tensor_parallel_degree", "2"],
        "with distill.teacher_path and parallelism.tensor_parallel_degree=2 is not supported",
    ),
    "lora on the head": (
        ["--peft.method", "lora", "--peft.target_modules", "wq,output"],
        "with peft.target_modules containing 'output' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_fused_loss_config_is_one_line(case):
    args, says = CASES[case]
    with pytest.raises(ConfigError) as e:
        build_config([*FUSED, *args])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_fused_loss_composes_with_data_parallel_and_lora_elsewhere():
    config = build_config([*FUSED, "--peft.method", "lora", "--parallelism.data_parallel_shard_degree",
                           "2"])  # fmt: skip
    assert config.loss.fused_linear_cross_entropy and config.loss.chunk_size == 256


def test_offloading_with_compile_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_config(["--activation_checkpoint.offload", "true", "--compile.enable", "true"])
    assert str(e.value).startswith("activation_checkpoint.offload=true with compile.enable=true")
