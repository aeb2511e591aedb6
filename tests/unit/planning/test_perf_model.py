import dataclasses

import pytest
import torch

from titanlab.models.common.counting import count_active_params, flops_per_token
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.planning.cluster import PROFILES
from titanlab.planning.compute_costs import ComputeCosts
from titanlab.planning.layouts import Layout
from titanlab.planning.perf_model import (
    ModelShape,
    Run,
    bubble_fraction,
    intra_node,
    predict,
    recompute_factor,
    _work,
    split_blocks,
)

H100 = PROFILES["h100"]


def _args(family: str, flavor: str, **changes):
    return dataclasses.replace(get_flavor(get_family(family), flavor), **changes)


@pytest.mark.parametrize("family, flavor", [("llama3", "8B"), ("qwen3_moe", "30B-A3B")])
def test_flops_per_token_are_the_trainers(family, flavor):
    """MFU must mean the same in the planner as in the trainer's metrics line."""
    args = _args(family, flavor, max_seq_len=8)
    shape = ModelShape.of(args)
    with torch.device("meta"):
        model = build_model(args)
    active = count_active_params(model, exclude_embedding=True)
    assert shape.flops_per_token(8192) == flops_per_token(args, 8192, active)


def test_the_8b_shape():
    shape = ModelShape.of(_args("llama3", "8B"))
    assert shape.total_params == 8_030_261_248
    assert shape.output_params == 128256 * 4096
    assert shape.moe_layers == 0 and shape.expert_params == 0
    moe = ModelShape.of(_args("qwen3_moe", "30B-A3B", max_seq_len=8))
    assert moe.num_experts == 128 and moe.top_k == 8 and moe.moe_layers == 48


def test_recomputation_by_ac_mode():
    """Worked by hand from the 8B's counts: full AC reruns the blocks' forward (2 FLOPs per
    block weight, 4·H·Q·s of attention per layer), not the head; op-level selective AC every
    other matmul of the blocks' forward (attention's output is saved)."""
    shape = ModelShape.of(_args("llama3", "8B"))
    s, layers = 8192, 32
    block = (shape.active_params - 128256 * 4096) / layers
    base = 6 * shape.active_params + 12 * layers * 32 * 128 * s
    forward = 2 * layers * block + 4 * layers * 32 * 128 * s
    assert recompute_factor(shape, s, "none") == 1.0
    assert recompute_factor(shape, s, "full") == pytest.approx(1 + forward / base)
    assert recompute_factor(shape, s, "selective_op") == pytest.approx(1 + layers * block / base)
    assert recompute_factor(shape, s, "selective_2") == pytest.approx(1 + forward / 2 / base)
    with pytest.raises(ValueError, match="ac_mode='partial'"):
        recompute_factor(shape, s, "partial")


def test_bubbles():
    assert bubble_fraction(None, 1, 8, 1) == 0.0
    assert bubble_fraction("1F1B", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble_fraction("GPipe", 4, 8, 1) == pytest.approx(3 / 8)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(3 / 48)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == pytest.approx(3 / 48)
    with pytest.raises(ValueError, match="'Chimera' has no bubble model"):
        bubble_fraction("Chimera", 4, 8, 2)


def test_groups_on_one_node_use_the_fast_link():
    node = H100.with_nodes(2)
    lay = Layout(1, 2, 8, 1, None, 1)  # tp 8 innermost: one node; dp_shard over 2 nodes
    assert intra_node(lay, ("tp",), node) and not intra_node(lay, ("dp_shard",), node)
    lay = Layout(2, 1, 4, 2, "1F1B", 1)  # 16 ranks: pp outermost spans the nodes
    assert intra_node(lay, ("tp",), node) and intra_node(lay, ("dp_replicate",), node)
    assert not intra_node(lay, ("pp",), node)
    # 24 ranks on 3 nodes: dp_shard 3 × tp 2 spans 6 ranks, and the group of ranks 6-11
    # straddles nodes 0 and 1
    assert not intra_node(Layout(4, 3, 2, 1, None, 1), ("dp_shard",), H100.with_nodes(3))


def test_a_ring_costs_what_the_alpha_beta_model_says():
    """All-reduce of 1 GiB of fp32 gradients over 8 DDP ranks on one H100 node, one call per
    `replicate` unit (the block, then the root: embedding, norm and head together; each pays
    the ring's 7 α): 2 × (2 × 7 α + 7/8 × M / (0.8 × 450 GB/s)), behind the backward except
    what exceeds the compute."""
    shape = ModelShape.of(_args("llama3", "8B", n_layers=1))
    run = Run(seq_len=1536, global_batch=16)
    pred = predict(shape, run, Layout(1, 8, 1, 1, None, 1, zero_stage=0), H100)
    (ar,) = [c for c in pred.comm if c.kind == "all-reduce"]
    m = shape.total_params * 4
    units = 1 + 1
    want = 2 * (units * 7 * 5e-6 + 7 / 8 * m / (0.8 * 450e9))
    assert ar.bytes == pytest.approx(m) and ar.calls == units
    assert ar.seconds == pytest.approx(want)
    assert ar.seconds / units < pred.compute_s < ar.seconds  # partly hidden
    assert ar.exposed == pytest.approx(ar.seconds - pred.compute_s + ar.seconds / units)


def test_data_parallel_collectives_hide_behind_one_compute_window_together():
    """HSDP across 8 nodes: FSDP's gathers and reduce-scatters and the replicas' all-reduce
    share the step's compute once; whatever exceeds it is exposed."""
    shape = ModelShape.of(_args("llama3", "8B"))
    pred = predict(shape, Run(8192, 64), Layout(2, 32, 1, 1, None, 1), H100.with_nodes(8))
    dp = [c for c in pred.comm if c.dim in ("dp_shard", "dp_replicate")]
    assert {c.kind for c in dp} == {"all-gather", "reduce-scatter", "all-reduce"}
    total = sum(c.seconds for c in dp)
    assert total > pred.compute_s
    assert sum(c.exposed for c in dp) >= total - pred.compute_s


def test_the_busiest_pipeline_rank_sets_the_pace():
    """8B on pp 4 (1F1B): `layers_per_stage` gives [7, 9, 9, 7]; the last rank's 7 blocks and
    the 128k-vocabulary head outweigh a middle rank's 9 blocks."""
    shape = ModelShape.of(_args("llama3", "8B"))
    run = Run(8192, 8)
    one = predict(shape, run, Layout(1, 1, 1, 1, None, 1), H100)
    four = predict(shape, run, Layout(1, 1, 1, 4, "1F1B", 1), H100)
    block = (shape.active_params - shape.output_params) / 32
    last = 7 * (6 * block + 12 * 32 * 128 * 8192) + 6 * shape.output_params
    whole = 32 * (6 * block + 12 * 32 * 128 * 8192) + 6 * shape.output_params
    # compute scales with the FLOPs (matmul and attention at their own efficiencies): the
    # share is bounded by the two classes' shares
    ratio = four.compute_s / one.compute_s
    assert ratio == pytest.approx(last / whole, rel=0.03)
    assert four.bubble == pytest.approx(3 / 8)


def test_float8_runs_its_linear_layers_at_the_float8_peak_and_reports_mfu_of_bf16():
    shape = ModelShape.of(_args("llama3", "8B", n_layers=4))
    lay = Layout(1, 1, 1, 1, None, 1)
    bf16 = predict(shape, Run(8192, 1), lay, H100)
    fp8 = predict(shape, Run(8192, 1, dtype="float8"), lay, H100)
    attention = 12 * 4 * 32 * 128 * 8192 * 8192 / (989e12 * 0.85)
    assert fp8.compute_s == pytest.approx((bf16.compute_s - attention) / 2 + attention)
    flops = shape.flops_per_token(8192) * 8192
    assert fp8.mfu == pytest.approx(flops / (fp8.step_s * 989e12))


def test_a_batch_that_does_not_split_is_refused():
    shape = ModelShape.of(_args("llama3", "8B", n_layers=1))
    with pytest.raises(ValueError, match="global batch 6 does not split over dp 4"):
        predict(shape, Run(128, 6), Layout(1, 4, 1, 1, None, 1), H100)


def test_one_h100_step_of_the_8b_shaped_model_is_near_the_measured_one():
    """docs/performance.md: Llama 3 8B's dims with 11 blocks, seq 8192, batch 1, bf16, compiled,
    AC none on one H100: 0.333 s a step. The H100 profile's efficiencies were read off that
    run's profile (GEMM time, attention, optimizer, pointwise), so this checks that the model
    puts them together as the run did (issue 34 asks for 15%)."""
    shape = ModelShape.of(_args("llama3", "8B", n_layers=11))
    pred = predict(shape, Run(seq_len=8192, global_batch=1), Layout(1, 1, 1, 1, None, 1), H100)
    assert pred.step_s == pytest.approx(0.333, rel=0.15)
    assert pred.optimizer_s == pytest.approx(0.053, rel=0.15)


def test_ranks_sharing_cores_get_no_bubble_credit_and_wait_on_blocking_collectives():
    """4 CPU ranks on 2 cores: compute takes twice as long; a pipeline bubble costs nothing (an
    idle rank gives its core away); every collective is waited for whole: FSDP2 blocks on its
    collectives on CPU (also with a core per rank), TP's and the pipeline's sends block. On
    GPUs the same FSDP collectives hide behind the compute."""
    cpu = dataclasses.replace(
        H100, name="cpu", devices_per_node=4, peak_flops={"float32": 5e10},
        intra_latency=2e-3, inter_latency=2e-3, intra_bandwidth=1e9, inter_bandwidth=1e9,
        shared_cores=2, device_type="cpu",
    )  # fmt: skip
    own = dataclasses.replace(cpu, shared_cores=0)
    shape = ModelShape.of(_args("llama3", "debugmodel", vocab_size=4096))
    run = Run(128, 16, param_bytes=4, dtype="float32")
    fsdp = Layout(1, 4, 1, 1, None, 1)
    shared, alone = predict(shape, run, fsdp, cpu), predict(shape, run, fsdp, own)
    assert shared.compute_s == pytest.approx(2 * alone.compute_s)
    assert shared.comm and all(c.exposed == c.seconds for c in shared.comm + alone.comm)
    gpu = predict(shape, run, fsdp, dataclasses.replace(own, device_type="cuda"))
    assert sum(c.exposed for c in gpu.comm) < sum(c.seconds for c in gpu.comm)
    pipe = predict(shape, run, Layout(1, 2, 1, 2, "GPipe", 1), cpu)
    assert pipe.bubble > 0 and pipe.bubble_s == 0
    tp = predict(shape, run, Layout(1, 2, 2, 1, None, 1), cpu)
    blocking = [c for c in tp.comm + pipe.comm if c.dim in ("tp", "pp")]
    assert blocking and all(c.exposed == c.seconds for c in blocking)


def test_a_split_backward_costs_its_calibrated_seconds_per_split_block():
    """The debug model's 6 blocks on pp 2 × 2 stages per rank are [1, 2, 2, 1]; 8 microbatches.
    ZBV puts stages 0 and 3 on rank 0 (stage 0's weight half is its whole backward: 8 × 1 split)
    and 1, 2 on rank 1 (8 × 4); Interleaved zero bubble 0, 2 and 1, 3 (8 × 2, 8 × 3); 1F1B and
    GPipe split nothing."""
    shape = ModelShape.of(_args("llama3", "debugmodel", vocab_size=4096))
    run = Run(128, 16, pp_microbatch_size=1)
    cpu = dataclasses.replace(H100, split_backward_s=1e-3)
    for schedule, blocks in [("ZBVZeroBubble", 32), ("InterleavedZeroBubble", 24),
                             ("1F1B", 0), ("GPipe", 0)]:  # fmt: skip
        lay = Layout(2, 1, 1, 2, schedule, 1)
        plain, split = predict(shape, run, lay, H100), predict(shape, run, lay, cpu)
        work_blocks = split_blocks(shape, run, lay, _work(shape, run, lay))
        assert work_blocks == blocks
        assert split.step_s - plain.step_s == pytest.approx(1e-3 * blocks)
        assert split.split_backward_s == pytest.approx(1e-3 * blocks)


def test_tensor_parallel_costs_its_calibrated_overhead_per_block_and_microbatch():
    """TP 2 on 6 blocks, 2 microbatches a step: 12 block forwards and backwards on each rank."""
    shape = ModelShape.of(_args("llama3", "debugmodel", vocab_size=4096))
    run = Run(128, 16)
    cpu = dataclasses.replace(H100, tp_block_s=1e-3)
    tp = Layout(2, 1, 2, 1, None, 2)
    assert predict(shape, run, tp, cpu).step_s - predict(shape, run, tp, H100).step_s == (
        pytest.approx(12e-3)
    )
    assert predict(shape, run, tp, cpu).tp_overhead_s == pytest.approx(12e-3)
    dp = Layout(2, 1, 1, 1, None, 2)
    assert predict(shape, run, dp, cpu).step_s == predict(shape, run, dp, H100).step_s


def test_the_tp_overhead_is_what_remains_beyond_half_the_block_and_its_collectives():
    from titanlab.planning.calibrate_tp import tp_overhead_s

    # 8 collectives of 1 MB over 2 ranks: 8 × (α + 0.5 MB / β) = 8 × (1 ms + 0.5 ms)
    assert tp_overhead_s(0.050, 0.060, 2, 1000, 250, 4, 1e-3, 1e9) == pytest.approx(0.008)
    assert tp_overhead_s(0.010, 0.060, 2, 1000, 250, 4, 1e-3, 1e9) == 0.0


def test_muon_costs_its_newton_schulz_flops_and_all_to_alls():
    """Muon's step: AdamW's memory traffic less one moment on its matrices, plus the
    Newton-Schulz FLOPs split over the ranks that shard the matrices, plus two all-to-alls."""
    from titanlab.components.muon import takes_muon
    from titanlab.components.muon_sharded import ns_flops

    args = _args("llama3", "8B")
    shape = ModelShape.of(args)
    with torch.device("meta"):
        model = build_model(args)
    muon = [p for n, p in model.named_parameters() if takes_muon(n, p)]
    assert shape.muon_params == sum(p.numel() for p in muon)
    assert shape.muon_ns_flops == sum(ns_flops(tuple(p.shape), 1) for p in muon)
    lay = Layout(1, 8, 1, 1, None, 1)
    run = Run(seq_len=8192, global_batch=8)
    adamw = predict(shape, run, lay, H100)
    muon_run = dataclasses.replace(run, optimizer="Muon")
    got = predict(shape, muon_run, lay, H100)
    eff = H100.efficiency
    ns_s = 5 * shape.muon_ns_flops / 8 / (H100.flops("bfloat16") * eff.matmul)
    saved_s = 8 * shape.muon_params / 8 / (H100.memory_bandwidth * eff.optimizer)
    assert got.optimizer_s == pytest.approx(adamw.optimizer_s + ns_s - saved_s, rel=1e-9)
    (a2a,) = [c for c in got.comm if c.dim.endswith("(muon)")]
    assert a2a.kind == "all-to-all" and a2a.group == 8 and a2a.calls == 2
    assert a2a.bytes == pytest.approx(2 * shape.muon_params * run.grad_bytes / 8)
    assert not [c for c in adamw.comm if c.dim.endswith("(muon)")]
    # HSDP: replicas compute the same matrices, no Muon traffic crosses dp_replicate
    hsdp = predict(shape, muon_run, Layout(2, 4, 1, 1, None, 1), H100)
    assert [c.group for c in hsdp.comm if c.dim.endswith("(muon)")] == [4]


def test_ledger_costs_scale_to_the_layout():
    """With the per-op ledger's costs, compute is one sequence's cost × sequences per rank
    ÷ tp × cp over the busiest pipeline rank's blocks, the update per parameter held."""
    shape = ModelShape.of(_args("llama3", "8B"))
    costs = ComputeCosts(block_s=0.01, head_s=0.05, embedding_s=0.002, update_s_per_param=1e-11)
    run = Run(seq_len=8192, global_batch=64)
    fsdp = predict(shape, run, Layout(1, 8, 1, 1, None, 1), H100, costs)
    assert fsdp.compute_s == pytest.approx(8 * (32 * 0.01 + 0.05 + 0.002))  # 8 sequences a rank
    assert fsdp.optimizer_s == pytest.approx(1e-11 * shape.total_params / 8)
    tp = predict(shape, run, Layout(1, 4, 2, 1, None, 1), H100, costs)
    assert tp.compute_s == pytest.approx(fsdp.compute_s)  # twice the sequences over tp 2
    pipe = predict(shape, run, Layout(1, 4, 1, 2, "1F1B", 1), H100, costs)
    first, last = 16 * (16 * 0.01 + 0.002), 16 * (16 * 0.01 + 0.05)
    assert pipe.compute_s == pytest.approx(max(first, last))  # the stage with the head
    with pytest.raises(ValueError, match="head_s=-1"):
        ComputeCosts(0.0, -1, 0.0, 0.0)
