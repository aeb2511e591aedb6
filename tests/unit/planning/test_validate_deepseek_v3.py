"""What DeepSeek-V3 cannot run with yet is refused before launch with one line naming the option:
context parallel and 2D tensor parallel (multi-head latent attention), and document masking and
distillation while its multi-token prediction depths train (which pipeline and tensor parallel
now carry)."""

import dataclasses

import pytest

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.models.deepseek_v3 import deepseek_v3_flavors
from titanlab.planning.validate import validate_layout


def error(
    flavor: str, world: int = 4, config_change=None, args_change=None, **parallelism
) -> str | None:
    config = JobConfig()
    config.model.name, config.model.flavor = "deepseek_v3", flavor
    config.training.seq_len, config.training.local_batch_size = 64, 8
    for key, value in parallelism.items():
        setattr(config.parallelism, key, value)
    if config_change:
        config_change(config)
    dims = ParallelDims.from_config(config.parallelism, world)
    args = dataclasses.replace(deepseek_v3_flavors[flavor], vocab_size=4352, max_seq_len=64)
    if args_change:
        args = args_change(args)
    try:
        validate_layout(config, dims, args, "cpu")
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def _sequence_aux(args):
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance_coeff=1e-4))


def _doc_mask(c):
    c.data.document_mask = True


def _distill(c):
    c.distill.teacher_path = "/somewhere"


@pytest.mark.parametrize(
    ("flavor", "parallelism", "change", "named"),
    [
        ("debugmodel_deep", {"context_parallel_degree": 2}, None, "context_parallel_degree=2"),
        (
            "debugmodel_deep",
            {
                "tensor_parallel_degree": 4,
                "tensor_parallel_mode": "2d",
                "expert_parallel_degree": 4,
            },
            None,
            "tensor_parallel_mode=2d",
        ),
        ("debugmodel", {}, _doc_mask, "data.document_mask=true"),
        ("debugmodel", {}, _distill, "distill.teacher_path"),
    ],
)
def test_refused_with_one_line(flavor, parallelism, change, named):
    message = error(flavor, config_change=change, **parallelism)
    assert message is not None and named in message, message


def test_the_same_layouts_pass_without_the_refused_part():
    assert error("debugmodel_deep", pipeline_parallel_degree=2) is None  # no MTP depths
    assert error("debugmodel_deep", tensor_parallel_degree=2, expert_parallel_degree=2) is None
    assert error("debugmodel", pipeline_parallel_degree=2) is None  # MTP on the last stage
    assert error("debugmodel", tensor_parallel_degree=2, expert_parallel_degree=2) is None
    assert error("debugmodel", world=8, tensor_parallel_degree=2, expert_parallel_degree=2,
                 pipeline_parallel_degree=2) is None  # fmt: skip
    assert (
        error("debugmodel", world=2, data_parallel_shard_degree=2, expert_parallel_degree=2) is None
    )


def test_the_sequence_wise_aux_loss_is_refused_where_ranks_split_a_sequence():
    message = error(
        "debugmodel_deep", args_change=_sequence_aux, tensor_parallel_degree=2,
        expert_parallel_degree=2,
    )  # fmt: skip
    assert message is not None and "sequence-wise load-balance loss" in message, message
    assert "tensor_parallel_degree=2" in message
    assert error("debugmodel_deep", args_change=_sequence_aux, pipeline_parallel_degree=2) is None
