"""The pre-flight's order: a reason no degree can fix comes before the degree checks.

DeepSeek-V3 (routed experts, multi-head latent attention) and Qwen3-MoE (per-head q/k norms,
routed experts) do not run under 2D, 2.5D or 3D tensor parallel yet. Before, a 2D layout got
"raise expert_parallel_degree to a multiple of tp" at ep 1 and "set it back to 1" at ep 4, and
the deciding reason was never named; now every ep gets the same line naming it.
"""

from __future__ import annotations

import os

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning import preflight

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize(
    ("config_file", "parts"),
    [
        ("deepseek_v3_debug.toml", "deepseek_v3 (routed experts, multi-head latent attention)"),
        ("qwen3_moe_debug.toml", "qwen3_moe (per-head q/k norms, routed experts)"),
    ],
)
@pytest.mark.parametrize(
    ("world", "mode", "depth", "eps"),
    [(4, "2d", 1, (1, 2, 4)), (8, "2.5d", 2, (1, 8)), (8, "3d", 1, (1, 2, 8))],
)
def test_2d_tensor_parallel_names_the_model_at_every_expert_parallel_degree(
    config_file, parts, world, mode, depth, eps, tmp_path
):
    for ep in eps:
        config = build_config([
            "--job.config_file", os.path.join(REPO, "train_configs", config_file),
            "--job.dump_folder", str(tmp_path / "out"),
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.tensor_parallel_degree", str(world),
            "--parallelism.tensor_parallel_mode", mode,
            "--parallelism.tensor_parallel_depth", str(depth),
            "--parallelism.expert_parallel_degree", str(ep),
        ])  # fmt: skip
        with pytest.raises(ConfigError) as e:
            preflight.check(config, world, world)
        line = str(e.value)
        assert line == (
            f"parallelism.tensor_parallel_mode={mode} with model.name={parts} is not supported "
            "yet (2D, 2.5D and 3D tensor parallel cover dense training with the plain loss); "
            "use tensor_parallel_mode=1d"
        ), (ep, line)


def test_memory_false_judges_the_rules_without_the_memory_estimate(tmp_path, monkeypatch):
    """The feature-pair matrix's verdicts: Llama 3 8B on 2 CPU ranks passes every rule but not
    the memory check; with memory=False the plan comes back without an estimate, nothing is
    traced, and a rule's refusal is still raised."""
    from titanlab.planning import activation_memory, memory

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "llama_8b.toml"),
            "--job.dump_folder", str(tmp_path / "out"), "--compile.enable", "false",
            "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    monkeypatch.setattr(
        memory, "available_bytes_per_rank", lambda n: (8 * 2**30, "8.0 GiB of host memory")
    )
    with pytest.raises(ConfigError, match="needs about"):
        preflight.check(build_config(argv), 2, 2)

    def no_trace(*args, **kwargs):
        raise AssertionError("memory=False traced the activations")

    monkeypatch.setattr(activation_memory, "trace_activation_bytes", no_trace)
    plan = preflight.check(build_config(argv), 2, 2, memory=False)
    assert plan.memory is None and plan.parallel_dims.dp_shard == 2
    with pytest.raises(ConfigError, match="does not equal the world size 2"):
        preflight.check(
            build_config([*argv, "--parallelism.tensor_parallel_degree", "3"]), 2, 2, memory=False
        )


def test_a_pipeline_stage_without_a_lora_target_is_one_line(tmp_path):
    """Qwen3.5's debug model on 2 pipeline stages: the first holds layers 0-2, all linear
    attention, so LoRA on `wq` and `output` would leave it nothing to train; `wo` adapts every
    stage and passes."""
    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "qwen3_5_debug.toml"),
            "--job.dump_folder", str(tmp_path / "out"),
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.pipeline_parallel_degree", "2", "--peft.method", "lora"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        preflight.check(build_config([*argv, "--peft.target_modules", "wq,output"]), 2, 2,
                        memory=False)  # fmt: skip
    assert str(e.value).startswith(
        "peft.target_modules ['wq', 'output'] adapt no Linear of pipeline stage 0 "
        "(tok_embeddings layers.0 layers.1 layers.2) of model.name=qwen3_5"
    )
    preflight.check(build_config([*argv, "--peft.target_modules", "wo,output"]), 2, 2, memory=False)
