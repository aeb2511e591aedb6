import dataclasses

import pytest
import torch

from titanlab.models.common.decoder import count_active_params, count_params, flops_per_token
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.planning.cluster import PROFILES
from titanlab.planning.layouts import Layout
from titanlab.planning.perf_model import (
    ModelShape,
    Run,
    bubble_fraction,
    intra_node,
    predict,
    recompute_factor,
)


def _args(family: str, flavor: str, **changes):
    return dataclasses.replace(get_flavor(get_family(family), flavor), **changes)


def test_dense_flops_per_token_are_the_trainers():
    args = _args("llama3", "8B")
    shape = ModelShape.of(args)
    assert shape.total_params == 8_030_261_248
    with torch.device("meta"):
        model = build_model(args)
    want = flops_per_token(args, 8192, count_params(model, exclude_embedding=True))
    # the trainer's count includes the norms' weights (not matmuls): 65 × 4096 × 6 FLOPs
    assert 0 <= want - shape.flops_per_token(8192) <= 6 * 65 * 4096


def test_an_moe_token_meets_its_top_k_experts_only():
    args = _args("qwen3_moe", "30B-A3B", max_seq_len=8)
    shape = ModelShape.of(args)
    with torch.device("meta"):
        model = build_model(args)
    active_matmul = count_active_params(model) - shape.embedding_params
    assert shape.matmul_flops_per_token() == pytest.approx(6 * active_matmul, rel=2e-3)
    assert shape.num_experts == 128 and shape.top_k == 8 and shape.moe_layers == 48


def test_recomputation_and_bubbles():
    shape = ModelShape.of(_args("llama3", "8B"))
    assert recompute_factor(shape, 8192, "none") == 1.0
    assert recompute_factor(shape, 8192, "full") == pytest.approx(4 / 3)
    attention = shape.attention_flops_per_token(8192) / shape.flops_per_token(8192)
    assert recompute_factor(shape, 8192, "selective_op") == pytest.approx(1 + attention / 3)
    assert recompute_factor(shape, 8192, "selective_2") == pytest.approx(1 + 1 / 6)
    assert bubble_fraction(None, 1, 8, 1) == 0.0
    assert bubble_fraction("1F1B", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble_fraction("GPipe", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(3 / 48)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == pytest.approx(3 / 48)


def test_groups_on_one_node_use_the_fast_link():
    node = PROFILES["h100"].with_nodes(2)
    lay = Layout(1, 2, 8, 1, None, 1)  # tp 8 innermost: one node; dp_shard over 2 nodes
    assert intra_node(lay, ("tp",), node) and not intra_node(lay, ("dp_shard",), node)
    lay = Layout(2, 1, 4, 2, "1F1B", 1)  # 16 ranks: pp outermost spans the nodes
    assert intra_node(lay, ("tp",), node) and intra_node(lay, ("dp_replicate",), node)
    assert not intra_node(lay, ("pp",), node)
    run = Run(seq_len=8192, global_batch=16)
    shape = ModelShape.of(_args("llama3", "8B"))
    inside = predict(shape, run, Layout(1, 2, 8, 1, None, 1), node)
    across = predict(shape, run, Layout(1, 8, 2, 1, None, 1), node)
    tp_in = sum(c.seconds for c in inside.comm if c.dim == "tp")
    assert tp_in > 0 and all(c.intra_node for c in inside.comm if c.dim == "tp")
    assert all(not c.intra_node for c in across.comm if c.dim == "dp_shard")


def test_one_h100_step_of_the_8b_shaped_model_is_near_the_measured_one():
    """docs/performance.md: Llama 3 8B's dims with 11 blocks, seq 8192, batch 1, bf16, compiled,
    AC none on one H100: 0.333 s a step. The H100 profile's efficiencies were read off that
    run's profile (GEMM time, attention, optimizer, pointwise), so this checks that the model
    puts them together as the run did (issue 34 asks for 15%)."""
    shape = ModelShape.of(_args("llama3", "8B", n_layers=11))
    pred = predict(shape, Run(seq_len=8192, global_batch=1), Layout(1, 1, 1, 1, None, 1),
                   PROFILES["h100"])  # fmt: skip
    assert pred.step_s == pytest.approx(0.333, rel=0.15)
    assert pred.optimizer_s == pytest.approx(0.053, rel=0.15)
