"""Pre-flight memory estimate and the one-line error for configs that cannot fit."""

import dataclasses

import pytest
import torch

from titanlab.planning import memory
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.planning.memory import GIB, check_memory, estimate_memory
from titanlab.models.llama3 import llama3_flavors

LLAMA3_8B_PARAMS = 8_030_261_248


def model_args(flavor: str, vocab: int, seq: int):
    return dataclasses.replace(llama3_flavors[flavor], vocab_size=vocab, max_seq_len=seq)


def job(flavor="8B", seq=8192, local_batch=1, ac="none", memory_check=True) -> JobConfig:
    """A JobConfig with the plain loss (the fused loss, auto's choice here, has its own test)."""
    c = JobConfig()
    c.loss.fused_linear_cross_entropy = False
    c.model.flavor = flavor
    c.training.seq_len, c.training.local_batch_size = seq, local_batch
    c.training.memory_check = memory_check
    c.activation_checkpoint.mode = ac
    return c


def estimate_8b(ac="none", world_size=8, dtype=torch.bfloat16):
    return estimate_memory(model_args("8B", 128256, 8192), job(ac=ac), world_size, dtype)


@pytest.fixture
def host_with_8_gib(monkeypatch):
    """Pretend each rank has 8 GiB of host memory, whatever this machine has."""
    monkeypatch.setattr(
        memory,
        "available_bytes_per_rank",
        lambda n: (8 * GIB, f"8.0 GiB of host memory shared by {n} CPU process(es)"),
    )


def test_8b_fsdp_sharded_states_are_exact():
    est = estimate_8b()
    assert est.params == 4 * LLAMA3_8B_PARAMS // 8 == 4_015_130_624
    assert est.grads == est.params
    assert est.optimizer == 2 * est.params


def test_8b_logits_and_gathered_blocks():
    est = estimate_8b()
    # The loss keeps the fp32 log-softmax, and backward makes two fp32 gradients of the logits;
    # the rest of the head (embedding output, final norm) is a few s·h tensors.
    fp32_logits = 8192 * 128256 * 4
    assert 3 * fp32_logits < est.logits < 3 * fp32_logits + 4 * 8192 * 4096 * 4
    block_params = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    head_params = 4096 + 128256 * 4096  # final norm + output: one FSDP unit
    # At the start of backward the norm + output unit (never resharded after forward) is
    # gathered: more than the two blocks in flight during forward.
    assert head_params > 2 * block_params
    assert est.gathered_params == head_params * 2  # bf16
    assert estimate_8b(world_size=1).gathered_params == 0  # nothing to gather without sharding


def test_auto_takes_the_fused_loss_and_its_one_chunk_of_logits_at_8k_tokens():
    config = job()
    config.loss.fused_linear_cross_entropy = "auto"
    est = estimate_memory(model_args("8B", 128256, 8192), config, 8, torch.bfloat16)
    # A chunk's fp32 logits and bf16 matmul output, the head weight's fp32 gradient (the fused
    # head computes it in forward) and the rows of the logits' gradient its one GEMM takes
    # (8192 in bf16: as many bytes as that fp32 gradient); no fp32 (tokens × vocab) tensor.
    chunk, weight_grad = 1024 * 128256 * (4 + 2), 128256 * 4096 * 4
    rows = 8192 * 128256 * 2
    low = chunk + weight_grad + rows
    assert low <= est.logits <= low + 4 * 8192 * 4096 * 4
    assert estimate_8b().logits > 3 * 8192 * 128256 * 4 > 2 * est.logits  # plain: 3 fp32 logits


def test_zero_stages_change_what_is_sharded_and_what_stays_gathered():
    def estimate(stage: int, accumulate: bool = False):
        config = job()
        config.parallelism.zero_stage = stage
        if accumulate:
            config.training.global_batch_size = 16  # 8 ranks × 1 sample × 2 microbatches
        return estimate_memory(model_args("8B", 128256, 8192), config, 8, torch.bfloat16)

    three, two, one, zero = (estimate(s) for s in (3, 2, 1, 0))
    assert three.params == two.params == one.params == zero.params // 8
    # Stages 1 and 2 keep every unit gathered through backward; DDP (FSDP2's replicate) holds
    # the gathered copy beside its one-rank "shard": the whole model once more, in bf16.
    assert two.gathered_params == one.gathered_params == zero.gathered_params
    assert zero.gathered_params == 2 * LLAMA3_8B_PARAMS
    assert three.gathered_params == 2 * (4096 + 128256 * 4096)  # the norm + output unit
    assert zero.optimizer == 8 * three.optimizer
    assert estimate(1, accumulate=True).grads == 8 * estimate(2, accumulate=True).grads


def test_activation_checkpointing_order():
    none, selective, full = (estimate_8b(ac) for ac in ("none", "selective", "full"))
    assert full.activations < selective.activations < 0.3 * none.activations
    assert full.activations == 32 * 8192 * 4096 * 2  # each block keeps only its bf16 input
    # Full AC recomputes one block at a time in backward; op-level selective AC recomputes
    # inside the checkpointed region only.
    assert full.recompute == none.activations // 32 and selective.recompute == none.recompute == 0


def test_total_is_peak_plus_overhead():
    est = estimate_8b()
    backward = est.activations + max(est.logits, est.recompute)
    end = est.grads + est.last_block  # every gradient made, the first block's activations
    assert est.total == (
        est.params + est.optimizer + est.gathered_params + max(backward, end) + est.overhead
    )
    assert backward > end  # with the plain 8k × 128k logits the peak is at the start
    assert est.summary().endswith(" GiB") and "params 3.7" in est.summary()


def test_gradient_accumulation_keeps_gradients_through_forward():
    cfg = job()
    cfg.training.global_batch_size = 8 * 4  # 4 microbatches of 1 sample on 8 ranks
    plain = estimate_8b()
    accumulating = estimate_memory(model_args("8B", 128256, 8192), cfg, 8, torch.bfloat16)
    assert accumulating.total == plain.total + plain.grads


def test_8b_on_two_cpu_ranks_raises_one_line(host_with_8_gib):
    with pytest.raises(ConfigError) as info:
        check_memory(model_args("8B", 128256, 8192), job(), 2, 2, torch.float32)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.flavor=8B needs about ")
    assert "GiB per rank" in message and "on 2 rank(s)" in message
    assert "debugmodel" in message and "--training.memory_check false" in message


def test_debugmodel_fits(host_with_8_gib):
    est = check_memory(
        model_args("debugmodel", 4352, 256), job("debugmodel", 256, 8), 2, 2, torch.float32
    )
    assert est.total < GIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads host memory only without CUDA")
def test_debugmodel_fits_on_this_host():
    have, what = memory.available_bytes_per_rank(2)
    assert have > GIB
    assert what.endswith(f"shared by 2 CPU process(es), {have / GIB:.1f} GiB each")
    est = check_memory(
        model_args("debugmodel", 4352, 256), job("debugmodel", 256, 8), 2, 2, torch.float32
    )
    assert est.total < have


def test_memory_check_off_does_not_raise(host_with_8_gib):
    est = check_memory(model_args("8B", 128256, 8192), job(memory_check=False), 2, 2, torch.float32)
    assert est.total > 8 * GIB


def test_estimate_memory_tool_prints_table_and_verdict(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "estimate_memory.py")
    spec = importlib.util.spec_from_file_location("estimate_memory_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert (
        tool.main(["--nproc", "2", "--model.flavor", "debugmodel", "--training.seq_len", "256"])
        == 0
    )
    out = capsys.readouterr().out
    assert "activations" in out and "total" in out and "→ fits" in out
    assert tool.main(["--nproc", "1", "--model.flavor", "405B", "--training.seq_len", "8192"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_expert_parallel_gathers_fewer_experts_and_keeps_all_to_all_buffers():
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    args = dataclasses.replace(qwen3_moe_flavors["30B-A3B"], vocab_size=151936, max_seq_len=4096)
    config = job(flavor="30B-A3B", seq=4096)
    config.model.name = "qwen3_moe"
    by_ep = {}
    for ep in (1, 2, 8):
        config.parallelism.expert_parallel_degree = ep
        by_ep[ep] = estimate_memory(args, config, 8, torch.bfloat16)
    one, two, eight = by_ep[1], by_ep[2], by_ep[8]
    # The experts are sharded over ep × efsdp = the same 8 ranks: states do not change.
    assert one.params == two.params == eight.params and one.optimizer == eight.optimizer
    # 128 experts of 3 · 2048 · 768 weights per layer; FSDP gathers E / ep of them (bf16, 2 blocks).
    experts = 128 * 3 * 2048 * 768
    assert one.gathered_params - two.gathered_params == 2 * 2 * (experts - experts // 2)
    # At ep 8 two blocks hold less than the norm + output unit, which is what stays gathered.
    head = 2 * (2048 + 151936 * 2048)
    assert eight.gathered_params == max(head, one.gathered_params - 4 * (experts - experts // 8))
    assert eight.gathered_params == head
    # all-to-all: received slots + their regrouped copy, 4096 tokens × top-8 × 2048 bf16, 48 layers.
    assert one.a2a_buffers == 0
    assert two.a2a_buffers == eight.a2a_buffers == 48 * 2 * 4096 * 8 * 2048 * 2


@pytest.mark.parametrize("pp", [1, 2])
def test_whole_gradients_hold_only_this_ranks_experts_under_expert_parallel(pp):
    """ZeRO-1 with accumulation (pp 1) and FSDP under a pipeline (pp 2) keep whole gradients
    until the step's reduce-scatter: the dense weights' and, under EP, num_experts / ep of the
    experts', not every expert's (671B on 256 ranks was estimated at 343 GiB of gradients)."""
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    args = dataclasses.replace(qwen3_moe_flavors["30B-A3B"], vocab_size=151936, max_seq_len=4096)
    config = job(flavor="30B-A3B", seq=4096, local_batch=2)
    config.model.name = "qwen3_moe"
    p = config.parallelism
    p.pipeline_parallel_degree = pp
    if pp == 1:
        p.zero_stage = 1
        config.training.global_batch_size = 2 * 2 * 16  # accumulation: whole gradients
    else:
        p.pipeline_parallel_microbatch_size = 1
    experts = 48 * 128 * 3 * 2048 * 768
    total = 30_532_122_624
    grads = {}
    for ep in (1, 8):
        p.expert_parallel_degree = ep
        grads[ep] = estimate_memory(args, config, 16 * pp, torch.bfloat16).grads
    assert grads[1] - grads[8] == pytest.approx(4 * (experts - experts // 8) / pp, rel=0.02)
    assert grads[1] == pytest.approx(4 * total / pp, rel=0.02)


def test_all_to_all_buffers_are_kept_only_by_blocks_that_keep_their_activations():
    """Full AC recomputes an MoE block's all-to-all in backward: none kept but the one block
    being recomputed (671B's config was estimated at 103 GiB of buffers under full AC)."""
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    args = dataclasses.replace(qwen3_moe_flavors["30B-A3B"], vocab_size=151936, max_seq_len=4096)
    layer = 2 * 4096 * 8 * 2048 * 2  # slots + regrouped copy: tokens × top-8 × dim, bf16
    by_ac = {}
    for ac in ("none", "full"):
        config = job(flavor="30B-A3B", seq=4096, ac=ac)
        config.model.name = "qwen3_moe"
        config.parallelism.expert_parallel_degree = 8
        by_ac[ac] = estimate_memory(args, config, 8, torch.bfloat16)
    assert by_ac["none"].a2a_buffers == 48 * layer
    assert by_ac["full"].a2a_buffers == 0
    assert by_ac["full"].recompute - by_ac["none"].last_block == 0  # both one block + its a2a
    assert by_ac["none"].last_block > layer


def test_muon_keeps_one_momentum_buffer_for_the_blocks_matrices():
    adamw = estimate_8b()
    config = job()
    config.optimizer.name = "Muon"
    muon = estimate_memory(model_args("8B", 128256, 8192), config, 8, torch.bfloat16)
    embeddings = 2 * 128256 * 4096  # tok_embeddings and output stay on AdamW, as do the norms
    norms = 4096 * (2 * 32 + 1)
    matrices = LLAMA3_8B_PARAMS - embeddings - norms
    assert adamw.optimizer - muon.optimizer == pytest.approx(4 * matrices / 8, rel=1e-6)


def test_a_refusal_names_its_largest_part_and_the_option_that_shrinks_it(host_with_8_gib):
    """Issue 64: the 235B refusal sent users to more devices when most of the bytes were
    activations, which more devices do not shrink; the line names the largest part and the
    option that shrinks it: full AC for activations, the fused loss for logits, and once AC is
    full and the loss fused, context parallel."""
    cases = [  # (AC, seq_len, fused loss): the largest part, the option named
        ("none", 8192, False, "activations", "--activation_checkpoint.mode full"),
        ("full", 65536, False, "logits", "--loss.fused_linear_cross_entropy true"),
        ("full", 65536, True, "activations", "--parallelism.context_parallel_degree"),
    ]
    for ac, seq, fused, largest, words in cases:
        cfg = job(seq=seq, ac=ac)
        cfg.loss.fused_linear_cross_entropy = fused
        args = model_args("8B", 128256, seq)
        est = estimate_memory(args, cfg, 64, torch.float32)
        parts = {n: getattr(est, n) for n in ("params", "optimizer", "activations", "logits")}
        assert max(parts, key=lambda n: parts[n]) == largest, parts
        with pytest.raises(ConfigError) as info:
            check_memory(args, cfg, 64, 8, torch.float32)
        message = str(info.value)
        assert f"{largest} {parts[largest] / GIB:.1f} GiB are the largest part: " in message
        assert words in message.split("largest part: ")[1].split(";")[0]
        assert "\n" not in message


def test_the_summary_lists_what_makes_the_peak_and_adds_up_to_it():
    """The refusal for DeepSeek-V3 671B without pipeline parallel listed parts that summed to
    48.2 of 152.7 GiB: it left out one block's recomputation (107.9 GiB) and listed the
    gradients, which are not alive at the start of backward."""
    from titanlab.planning.memory_estimate import GIB, MemoryEstimate, shrinking_option

    start = MemoryEstimate(params=5 * GIB, grads=5 * GIB, optimizer=10 * GIB,
                           gathered_params=2 * GIB, activations=27 * GIB, logits=-2 * GIB,
                           overhead=GIB, recompute=108 * GIB, last_block=GIB)  # fmt: skip
    end = MemoryEstimate(params=GIB, grads=40 * GIB, optimizer=GIB, gathered_params=0,
                         activations=GIB, logits=GIB, overhead=GIB, last_block=3 * GIB)  # fmt: skip
    for est in (start, end):
        assert sum(b for _, b in est.peak_parts()) == est.total
    assert start.summary() == ("params 5.0, optimizer 10.0, gathered_params 2.0, activations "
                               "27.0, recomputed block 108.0, overhead 1.0 GiB")  # fmt: skip
    assert "grads 40.0, first block's activations 3.0" in end.summary()
    assert shrinking_option(start, job()).startswith("recomputed block 108.0 GiB are the largest")
