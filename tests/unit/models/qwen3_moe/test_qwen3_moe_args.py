"""Qwen3-MoE flavors: published total and active parameter counts, sparse-layer rule."""

import dataclasses

import pytest
import torch

from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.counting import count_active_params, count_params
from titanlab.models.qwen3_moe import Qwen3MoETransformer, qwen3_moe_flavors

# (total, active) parameters in billions as published (Qwen3 Technical Report, model cards).
PUBLISHED = {"30B-A3B": (30.5, 3.3), "235B-A22B": (235.0, 22.0)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_total_and_active_parameters_match_the_published_figures(flavor):
    with torch.device("meta"):
        model = Qwen3MoETransformer(dataclasses.replace(qwen3_moe_flavors[flavor], max_seq_len=8))
    total, active = count_params(model) / 1e9, count_active_params(model) / 1e9
    want_total, want_active = PUBLISHED[flavor]
    # The model cards truncate to the digits shown (30.53 → 30.5, 3.35 → 3.3, 22.19 → 22).
    step_total, step_active = (0.1, 0.1) if want_total < 100 else (1.0, 1.0)
    assert want_total <= total < want_total + step_total, total
    assert want_active <= active < want_active + step_active, active
    assert len(moe_layers(model)) == model.args.n_layers


def test_sparse_step_and_dense_layers_follow_hf_rule():
    args = dataclasses.replace(
        qwen3_moe_flavors["debugmodel"],
        vocab_size=64,
        max_seq_len=8,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
    )
    model = Qwen3MoETransformer(args)
    sparse = [i for i in range(args.n_layers) if args.moe_layer(i) is not None]
    assert sparse == [1, 5]  # (i + 1) % 2 == 0, except the dense layer 3
    assert len(moe_layers(model)) == 2


def test_moe_layouts_that_cannot_run_are_refused_with_one_line():
    from titanlab.components import builders as components
    from titanlab.config.job_config import ConfigError
    from titanlab.config.manager import build_config
    from titanlab.distributed.parallel_dims import ParallelDims
    from titanlab.planning.validate import validate_layout

    for world, argv, message in (
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2"],
            "expert_parallel_degree a multiple of tp",
        ),
        (6, ["--parallelism.expert_parallel_degree", "3"], "must divide the number of experts"),
        (
            2,
            ["--model.name", "llama3", "--parallelism.expert_parallel_degree", "2"],
            "needs an MoE model",
        ),
    ):
        config = build_config(["--model.name", "qwen3_moe", "--training.seq_len", "64", *argv])
        args = components.build_model_args(config, 300)
        dims = ParallelDims.from_config(config.parallelism, world)
        with pytest.raises(ConfigError, match=message) as e:
            validate_layout(config, dims, args, "cpu")
        assert "\n" not in str(e.value)
