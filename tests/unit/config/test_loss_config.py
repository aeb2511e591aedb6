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
    "lora on the head under tp": (
        [
            "--peft.method",
            "lora",
            "--peft.target_modules",
            "wq,output",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        "with peft.target_modules containing 'output' and parallelism.tensor_parallel_degree=2 "
        "is not supported",
    ),
    "lora on the head with rl": (
        [
            "--peft.method",
            "lora",
            "--peft.target_modules",
            "output",
            "--rl.algorithm",
            "grpo",
            "--rl.group_size",
            "2",
        ],
        "containing 'output' and rl.algorithm=grpo is not supported",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_fused_loss_config_is_one_line(case):
    args, says = CASES[case]
    with pytest.raises(ConfigError) as e:
        build_config([*FUSED, *args])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_fused_loss_composes_with_data_parallel_and_lora_elsewhere_and_on_the_head():
    config = build_config([*FUSED, "--peft.method", "lora", "--parallelism.data_parallel_shard_degree",
                           "2"])  # fmt: skip
    assert config.loss.fused_linear_cross_entropy and config.loss.chunk_size == 1024
    build_config([*FUSED, "--peft.method", "lora", "--peft.target_modules", "wq,output"])


def test_offloading_with_compile_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_config(["--activation_checkpoint.offload", "true", "--compile.enable", "true"])
    assert str(e.value).startswith("activation_checkpoint.offload=true with compile.enable=true")


def test_auto_fuses_where_a_microbatch_holds_more_than_a_chunk_and_nothing_refuses_it():
    """The default (auto): fused above one chunk per microbatch; plain at or below it, and
    where `true` would be refused (the same case then runs, with the plain loss, instead of
    failing); true / false as given. Written as the option, so every rank agrees."""
    from titanlab.config.performance import fused_loss

    def resolved(*args: str) -> bool:
        config = build_config(["--training.local_batch_size", "2", *args])
        assert config.loss.fused_linear_cross_entropy == "auto"
        return fused_loss(config)

    assert build_config([]).loss.fused_linear_cross_entropy == "auto"
    assert resolved("--training.seq_len", "2048")  # 4096 tokens > 1024
    assert not resolved("--training.seq_len", "512")  # 1024 tokens: one chunk, nothing saved
    assert resolved("--training.seq_len", "128", "--loss.chunk_size", "64")
    for refused_with_true in CASES.values():
        args = refused_with_true[0]
        if "--loss.chunk_size" not in args:  # chunk 0 is refused whatever the loss
            assert not resolved("--training.seq_len", "2048", *args), args
    assert not fused_loss(build_config(["--loss.fused_linear_cross_entropy", "false",
                                        "--training.seq_len", "2048"]))  # fmt: skip
    assert fused_loss(build_config([*FUSED, "--training.local_batch_size", "1",
                                    "--training.seq_len", "256", "--loss.chunk_size", "256"]))  # fmt: skip


@pytest.mark.parametrize(
    "value, want", [("true", True), ("false", False), ("auto", "auto"), ("on", True)]
)
def test_the_option_takes_a_bool_or_auto_from_the_command_line(value, want):
    assert build_config(["--loss.fused_linear_cross_entropy", value]).loss.fused_linear_cross_entropy == want  # fmt: skip


def test_a_value_that_is_neither_a_bool_nor_auto_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_config(["--loss.fused_linear_cross_entropy", "maybe"])
    assert str(e.value) == (
        "loss.fused_linear_cross_entropy='maybe' is not valid; valid: true, false, auto"
    )


@pytest.mark.parametrize(
    "args,want",
    [
        ([], False),
        (["--compile.enable", "true"], True),
        (["--compile.enable", "true", "--compile.components", "model"], False),
        (["--compile.components", "loss"], False),
    ],
)
def test_the_loss_is_compiled_only_with_compile_on_and_loss_among_its_components(args, want):
    from titanlab.config.performance import compiles_loss

    assert compiles_loss(build_config(args)) is want
