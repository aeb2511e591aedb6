"""`parallelism.zero_stage` and `fsdp_sharding_strategy`: what each stage resolves to, and one
line before launch for a stage the layout cannot mean."""

from __future__ import annotations

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.distributed.parallelize import reshard_policy
from titanlab.planning import preflight

P = "--parallelism."


def dims(world: int, *args: str) -> ParallelDims:
    return ParallelDims.from_config(build_config(list(args)).parallelism, world)


@pytest.mark.parametrize(
    "args, stage",
    [([], 3), ([P + "zero_stage", "1"], 1), ([P + "fsdp_sharding_strategy", "SHARD_GRAD_OP"], 2),
     ([P + "fsdp_sharding_strategy", "NO_SHARD"], 0), ([P + "fsdp_sharding_strategy", "FULL_SHARD"], 3),
     ([P + "fsdp_sharding_strategy", "SHARD_GRAD_OP", P + "zero_stage", "2"], 2)],
)  # fmt: skip
def test_the_stage_in_force(args, stage):
    assert build_config(args).parallelism.zero_stage_in_force == stage


def test_stage_0_turns_the_shard_ranks_into_replicas():
    ddp = dims(4, P + "zero_stage", "0")
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.fsdp_enabled) == (4, 1, False)
    hsdp_to_ddp = dims(4, P + "zero_stage", "0", P + "data_parallel_replicate_degree", "2")
    assert (hsdp_to_ddp.dp_replicate, hsdp_to_ddp.dp_shard) == (4, 1)
    tp = dims(4, P + "zero_stage", "0", P + "tensor_parallel_degree", "2")
    assert (tp.dp_replicate, tp.dp_shard, tp.tp) == (2, 1, 2)
    assert dims(4, P + "zero_stage", "2").dp_shard == 4  # stages 1-3 shard over dp_shard


def test_stages_1_and_2_keep_parameters_gathered_after_forward():
    assert [reshard_policy("default", False, s) for s in (1, 2, 3)] == [False, False, True]
    assert reshard_policy("default", True, 3) is False  # under PP, as before


REFUSED = {
    "stage 5": ((2, P + "zero_stage", "5"), "parallelism.zero_stage=5 is not valid; valid: 0, 1, 2, 3"),
    "strategy against stage": (
        (2, P + "fsdp_sharding_strategy", "NO_SHARD", P + "zero_stage", "2"),
        "parallelism.fsdp_sharding_strategy=NO_SHARD means zero_stage 0, not "
        "parallelism.zero_stage=2; set one of them",
    ),
    "stage 2 resharding always": (
        (2, P + "zero_stage", "2", P + "fsdp_reshard_after_forward", "always"),
        "parallelism.zero_stage=2 keeps parameters gathered from forward to backward",
    ),
    "stage 1 on tensor parallel only": (
        (2, P + "zero_stage", "1", P + "tensor_parallel_degree", "2"),
        "parallelism.zero_stage=1 with no ranks to shard over (data_parallel_shard_degree × "
        "context_parallel_degree = 1) shards nothing",
    ),
    "stage 0 with context parallel": (
        (2, P + "zero_stage", "0", P + "context_parallel_degree", "2"),
        "parallelism.zero_stage=0 (DDP, nothing sharded) with parallelism."
        "context_parallel_degree=2 is not supported",
    ),
    "stage 0 on one rank": ((1, P + "zero_stage", "0"), "(DDP) with no data-parallel ranks"),
    "hybrid without replicas": (
        (2, P + "fsdp_sharding_strategy", "HYBRID_SHARD"),
        "parallelism.fsdp_sharding_strategy=HYBRID_SHARD needs data_parallel_replicate_degree "
        "> 1 and data_parallel_shard_degree > 1 (HSDP), not 1 and 2; or use FULL_SHARD",
    ),
    "offload at stage 1": (
        (2, P + "zero_stage", "1", "--training.enable_cpu_offload", "true"),
        "training.enable_cpu_offload=true with parallelism.zero_stage=1 is not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_stage_the_layout_cannot_mean_is_one_line_before_launch(case, tmp_path):
    (world, *args), says = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        config = build_config([*args, "--job.dump_folder", str(tmp_path / "run")])
        preflight.check(config, world, world)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_hybrid_shard_is_hsdp_and_offload_goes_with_stages_2_and_3(tmp_path):
    args = ["--job.dump_folder", str(tmp_path / "run")]
    hybrid = build_config([*args, P + "fsdp_sharding_strategy", "HYBRID_SHARD",
                           P + "data_parallel_replicate_degree", "2"])  # fmt: skip
    plan = preflight.check(hybrid, 4, 4)
    assert (plan.parallel_dims.dp_replicate, plan.parallel_dims.dp_shard) == (2, 2)
    for stage in ("2", "3"):
        offload = build_config([*args, P + "zero_stage", stage, "--training.enable_cpu_offload",
                                "true"])  # fmt: skip
        preflight.check(offload, 2, 2)
