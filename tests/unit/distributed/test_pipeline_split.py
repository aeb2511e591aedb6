"""Pipeline stages balanced by cost: the exact split, the costs, and a large-vocabulary model whose
slowest stage computes fewer FLOPs (counted as executed) when the stages are split by FLOPs
instead of by layers."""

import dataclasses
import itertools
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titanlab.config.job_config import ConfigError
from titanlab.config.parallelism import Parallelism
from titanlab.distributed import pipeline, pipeline_split
from titanlab.distributed.pipeline_split import UnitCosts, balanced_counts, unit_costs
from titanlab.models.common.decoder import moe_layers
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.qwen3_moe import qwen3_moe_flavors
from titanlab.models.registry import build_model

# The debug model's blocks with a 16k vocabulary: the output projection is 4.2M parameters, a
# block 0.74M, so by FLOPs the head is worth ~5 blocks.
LARGE_VOCAB = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=16384, n_layers=8)
SEQ = 256


def compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of `parts` positive integers."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


@pytest.mark.parametrize("seed", range(20))
def test_balanced_counts_is_the_best_contiguous_split(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(2, 9), rng.randint(1, 4)
    stages = min(stages, n)
    costs = UnitCosts(
        rng.randint(0, 50), tuple(rng.randint(1, 20) for _ in range(n)), rng.randint(0, 80)
    )
    counts = balanced_counts(costs, stages)
    assert sum(counts) == n and len(counts) == stages and min(counts) >= 1
    best = min(max(costs.stage_costs(c)) for c in compositions(n, stages))
    assert max(costs.stage_costs(counts)) == best


def test_too_many_stages_is_one_line():
    with pytest.raises(ConfigError, match="5 pipeline stages need at least as many layers"):
        balanced_counts(UnitCosts(0, (1, 1, 1, 1), 0), 5)


def meta_model(args):
    with torch.device("meta"):
        return build_model(args)


def test_costs_count_the_head_and_the_active_experts():
    model = meta_model(LARGE_VOCAB)
    params = unit_costs(model, LARGE_VOCAB, SEQ, "params")
    flops = unit_costs(model, LARGE_VOCAB, SEQ, "flops")
    dim, vocab = LARGE_VOCAB.dim, LARGE_VOCAB.vocab_size
    assert params.embedding == vocab * dim and params.head == vocab * dim + dim
    assert flops.embedding == 0 and flops.head == 6 * (vocab * dim + dim)  # a lookup; matmuls
    attention = 12 * LARGE_VOCAB.n_heads * LARGE_VOCAB.head_dim * SEQ
    assert flops.blocks[0] == 6 * params.blocks[0] + attention
    assert sum(flops.blocks) + flops.head == (
        6 * (sum(params.blocks) + params.head) + LARGE_VOCAB.n_layers * attention
    )  # the whole model's flops_per_token
    moe = dataclasses.replace(qwen3_moe_flavors["debugmodel"], vocab_size=2048)
    m = meta_model(moe)
    block = m.layers["0"]
    (layer,) = moe_layers(block)
    experts = sum(p.numel() for p in layer.experts.parameters())
    dense = sum(p.numel() for p in block.parameters()) - experts
    active = experts * layer.args.top_k // layer.args.num_experts
    assert 0 < active < experts
    attention = 12 * moe.n_heads * moe.head_dim * SEQ
    assert unit_costs(m, moe, SEQ, "flops").blocks[0] == 6 * (dense + active) + attention


def stage_flops(model, fqns: list[list[str]]) -> list[int]:
    """Forward + backward FLOPs of each stage module on one microbatch (1 × SEQ), counted by
    `torch.utils.flop_counter.FlopCounterMode` (matmuls and attention, as executed): what each
    pipeline rank computes per microbatch. A count, not a timing, so the test cannot be swayed
    by other work on the machine."""
    torch.manual_seed(0)
    tokens = torch.randint(0, LARGE_VOCAB.vocab_size, (1, SEQ))
    out = []
    h = None
    for names in fqns:
        stage = pipeline.build_stage_module(model, names)
        x = tokens if "tok_embeddings" in names else h.detach().requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            y = stage(x)
            y.float().square().mean().backward()
        h = y
        out.append(counter.get_total_flops())
    return out


def test_split_by_flops_makes_the_slowest_stage_cheaper_with_a_large_vocabulary():
    torch.manual_seed(0)
    model = build_model(LARGE_VOCAB)
    model.init_weights()
    costs = unit_costs(model, LARGE_VOCAB, SEQ, "flops")
    by_layers = pipeline.layers_per_stage(LARGE_VOCAB.n_layers, 2)
    by_flops = balanced_counts(costs, 2)
    assert by_layers == [4, 4] and by_flops == [6, 2]  # the head is worth ~5 blocks
    predicted = max(costs.stage_costs(by_flops)) / max(costs.stage_costs(by_layers))
    assert predicted < 0.8
    layers_f = stage_flops(model, pipeline.stage_fqns(8, 2, counts=by_layers))
    flops_f = stage_flops(model, pipeline.stage_fqns(8, 2, counts=by_flops))
    measured = max(flops_f) / max(layers_f)
    print(f"slowest stage: by layers {max(layers_f) / 1e9:.2f} GFLOP, by FLOPs "
          f"{max(flops_f) / 1e9:.2f} GFLOP ({measured:.2f}x; predicted {predicted:.2f}x)")  # fmt: skip
    # The model's per-token costs × SEQ against the counted ones (the first stage's input
    # gradient is not computed, the embedding lookup costs no matmul).
    assert measured < 0.8 and abs(measured - predicted) < 0.05, (layers_f, flops_f)


def test_describe_names_each_stage_and_the_gain():
    model = meta_model(LARGE_VOCAB)
    costs = {k: unit_costs(model, LARGE_VOCAB, SEQ, k) for k in ("params", "flops")}
    counts = balanced_counts(costs["flops"], 2)
    line = pipeline_split.describe(
        pipeline.stage_fqns(8, 2, counts=counts), costs, "flops", counts, [4, 4]
    )
    assert line.startswith("pipeline: 2 stages split by flops; the costliest stage does 53%")
    assert "(split by layers: 69%)" in line
    assert "stage 0 tok_embeddings layers.0-5: 8.62M params (131.5 MiB" in line
    assert "stage 1 layers.6-7 norm output: 5.67M params" in line


def test_a_cost_split_with_a_manual_split_is_one_line():
    p = Parallelism(pipeline_parallel_split="flops", pipeline_parallel_layers_per_stage=3)
    with pytest.raises(ConfigError, match="pipeline_parallel_split=flops balances the stages"):
        p.validate()
    Parallelism(pipeline_parallel_split="params").validate()
