"""Every invalid parallel combination is refused up front with a one-line message."""

import dataclasses
import json

import pytest


from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.planning.validate import validate_layout
from titanlab.models.llama3 import llama3_flavors


def error(
    world=4,
    flavor="debugmodel",
    device="cpu",
    seq_len=64,
    local_batch=8,
    compile_enable=False,
    **parallelism,
):
    """The ConfigError message of validating this layout (or None when it passes)."""
    config = JobConfig()
    config.compile.enable = compile_enable
    config.model.flavor = flavor
    config.training.seq_len, config.training.local_batch_size = seq_len, local_batch
    for key, value in parallelism.items():
        setattr(config.parallelism, key, value)
    dims = ParallelDims.from_config(config.parallelism, world)
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=4352, max_seq_len=seq_len)
    try:
        validate_layout(config, dims, args, device)
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def test_valid_layouts_pass():
    assert error(tensor_parallel_degree=2) is None
    assert error(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble") is None
    assert (
        error(world=2, pipeline_parallel_degree=2, pipeline_parallel_schedule="DualPipeV") is None
    )


def test_tp_must_divide_heads_and_kv_heads():
    # debugmodel: 8 heads, 4 KV heads.
    assert error(world=8, tensor_parallel_degree=8) == (
        "parallelism.tensor_parallel_degree=8 must divide the number of heads (8) and of KV heads"
        " (4) of debugmodel"
    )
    assert "number of heads (8)" in error(world=3, tensor_parallel_degree=3)


def test_seq_len_divisible_by_tp_and_2cp():
    assert error(tensor_parallel_degree=2, seq_len=63) == (
        "training.seq_len=63 must be divisible by tp × 2·cp = 2 (sequence parallel and "
        "load-balanced context parallel split it)"
    )
    assert "tp × 2·cp = 8" in error(
        world=4, device="cuda", tensor_parallel_degree=2, context_parallel_degree=2, seq_len=36
    )


def test_cp_runs_on_cpu_and_cuda_and_with_pp():
    assert error(world=2, context_parallel_degree=2) is None
    assert error(world=2, device="cuda", context_parallel_degree=2) is None
    assert error(world=4, context_parallel_degree=2, pipeline_parallel_degree=2) is None


def test_layers_must_cover_the_stages():
    # debugmodel has 6 layers; PP 4 × 2 stages per rank = 8 stages.
    assert error(pipeline_parallel_degree=4, pipeline_parallel_schedule="Interleaved1F1B") == (
        "8 pipeline stages need at least as many layers; the model has 6"
    )
    assert error(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=4) is None  # 3 + 3
    assert "gives 4 layers" in error(
        pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=3
    )


def test_microbatches_per_schedule():
    assert error(local_batch=1, pipeline_parallel_degree=2) == (
        "1F1B with 2 stages needs at least 2 microbatches, but local_batch_size / microbatch_size "
        "= 1 / 1 = 1"
    )
    assert "needs at least 4 microbatches" in error(
        world=2, local_batch=2, pipeline_parallel_degree=2, pipeline_parallel_schedule="DualPipeV"
    )
    assert error(
        local_batch=3, pipeline_parallel_degree=2, pipeline_parallel_schedule="LoopedBFS"
    ) == (
        "LoopedBFS needs the number of microbatches (3) to be a multiple of pipeline_parallel_degree=2"
    )
    assert error(
        local_batch=8, pipeline_parallel_degree=2, pipeline_parallel_microbatch_size=3
    ) == (
        "training.local_batch_size=8 is not divisible by parallelism.pipeline_parallel_microbatch_size=3"
    )
    assert "needs pipeline_parallel_stages_per_rank >= 2" in error(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="Interleaved1F1B",
        pipeline_parallel_stages_per_rank=1,
    )


def test_refused_torch_213_traps():
    assert error(pipeline_parallel_degree=2, pipeline_parallel_schedule="DualPipeV").startswith(
        "DualPipeV fails in torch 2.13 when pp is a sub-mesh"
    )
    assert "gives wrong gradients" in error(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="ZBVZeroBubble",
        fsdp_reshard_after_forward="always",
    )
    # DDP (FSDP2's replicate) composes with TP and PP since issue 16.
    assert (
        error(
            world=4,
            tensor_parallel_degree=2,
            data_parallel_replicate_degree=2,
            data_parallel_shard_degree=1,
        )
        is None
    )


def test_compile_with_tp_is_allowed():
    assert error(tensor_parallel_degree=2, compile_enable=True) is None


def test_tied_embeddings_cannot_be_pipelined():
    assert error(flavor="1B", pipeline_parallel_degree=2, seq_len=64).startswith(
        "model.flavor=1B ties the output to the embedding"
    )


def test_manual_stage_split():
    ok = ["tok_embeddings layers.0 layers.1 layers.2", "layers.3 layers.4 layers.5 norm output"]
    assert (
        error(world=2, pipeline_parallel_degree=2, pipeline_parallel_module_fqns_per_stage=ok)
        is None
    )
    assert "has 1 entries; the schedule needs 2 stages" in error(
        world=2, pipeline_parallel_degree=2, pipeline_parallel_module_fqns_per_stage=ok[:1]
    )
    for stages, words in [
        (["tok_embeddings layers.0 layers.1", "layers.3 layers.4 layers.5 norm output"],
         "misses ['layers.2']"),
        (["tok_embeddings layers.0 layers.1 layers.2", "layers.2 layers.3 layers.4 layers.5 norm output"],
         "puts ['layers.2'] in more than one place"),
        (["tok_embeddings layers.0 layers.1 layers.2", "layers.3 layers.4 layers.5 layers.6 norm output"],
         "names ['layers.6'], not modules of the model"),
        (["tok_embeddings layers.3 layers.1 layers.2", "layers.0 layers.4 layers.5 norm output"],
         "out of the model's order"),
    ]:  # fmt: skip
        msg = error(
            world=2, pipeline_parallel_degree=2, pipeline_parallel_module_fqns_per_stage=stages
        )
        assert msg is not None and words in msg and "\n" not in msg, msg


def test_zero_bubble_schedules_with_tp_are_refused():
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        msg = error(
            world=4,
            tensor_parallel_degree=2,
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule=schedule,
        )
        assert msg.startswith(f"{schedule} with tensor parallel fails in torch 2.13"), msg
    assert (
        error(
            world=4,
            tensor_parallel_degree=2,
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule="LoopedBFS",
        )
        is None
    )


def refusal(config: JobConfig, world: int, seq_len: int = 2048) -> str | None:
    """The one-line refusal of `config` on `world` ranks (None when accepted)."""
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=4352, max_seq_len=seq_len)
    try:
        validate_layout(config, ParallelDims.from_config(config.parallelism, world), args, "cpu")
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def test_document_mask_runs_under_context_parallel_and_ulysses_needs_divisible_heads():
    config = JobConfig()
    config.data.document_mask = True
    config.parallelism.context_parallel_degree = 2
    assert refusal(config, 2) is None  # ring CP with a document mask (titanlab's attention)
    config.parallelism.context_parallel_mode = "ulysses"
    assert refusal(config, 2) is None  # 8 heads over cp 2
    config.parallelism.context_parallel_degree = 32
    assert refusal(config, 32, 256) == (
        "parallelism.context_parallel_mode=ulysses with 8 attention heads, "
        "tensor_parallel_degree=1 and context_parallel_degree=32: Ulysses gives each rank "
        "heads / (tp × cp) heads, so the heads must divide by 32; use ring, or tp × cp dividing 8"
    )


def test_seq_len_warmup_is_refused_under_pipeline_parallel_and_must_split_under_tp():
    config = JobConfig()
    config.training.seq_len, config.training.seq_len_warmup_steps = 64, 10
    config.training.seq_len_warmup_start = 16
    config.parallelism.pipeline_parallel_degree = 2
    assert "training.seq_len_warmup_steps=10 with parallelism.pipeline_parallel_degree=2" in (
        refusal(config, 2, 64) or ""
    )
    config.parallelism.pipeline_parallel_degree, config.parallelism.context_parallel_degree = 1, 2
    config.parallelism.tensor_parallel_degree = 2
    assert refusal(config, 4, 64) is None
    config.training.seq_len_warmup_start = 4
    assert refusal(config, 4, 64) == (
        "training.seq_len_warmup_start=4 must be divisible by tp × 2·cp = 8, like seq_len"
    )


def test_qlora_is_refused_where_nf4_weights_would_be_replicated():
    config = JobConfig()
    config.peft.method, config.peft.quantize_base = "lora", "nf4"
    config.parallelism.data_parallel_replicate_degree = 2
    assert refusal(config, 2) == (
        "peft.quantize_base=nf4 with parallelism.data_parallel_replicate_degree=2: torchao's NF4 "
        "weights shard under FSDP but cannot be replicated (DDP, HSDP); use "
        "data_parallel_shard_degree for the data-parallel ranks"
    )
    config.parallelism.data_parallel_replicate_degree = 1
    assert refusal(config, 2) is None


def test_lora_and_qlora_run_under_tensor_parallel_but_qlora_not_with_fsdp_too():
    config = JobConfig()
    config.peft.method = "lora"
    config.parallelism.tensor_parallel_degree = 2
    assert refusal(config, 2) is None
    config.peft.dropout = 0.1  # the mask is the same on every TP rank (PositionDropout)
    assert refusal(config, 2) is None
    config.peft.dropout, config.peft.quantize_base = 0.0, "nf4"
    assert refusal(config, 2) is None  # NF4 shards per TP rank (titanlab.peft.nf4_split)
    assert refusal(config, 4) == (
        "peft.quantize_base=nf4 with parallelism.tensor_parallel_degree=2 and FSDP over 2 ranks "
        "(data_parallel_shard_degree × context_parallel_degree): torchao's NF4 cannot be "
        "all-gathered again by FSDP once it is a tensor-parallel shard; use TP or FSDP for "
        "QLoRA, not both"
    )


def test_distillation_runs_under_tensor_and_pipeline_parallel_but_not_context_parallel():
    config = JobConfig()
    config.distill.teacher_path = "/some/teacher"
    config.parallelism.tensor_parallel_degree = 2
    assert refusal(config, 2) is None
    config.parallelism.tensor_parallel_degree, config.parallelism.pipeline_parallel_degree = 1, 2
    assert refusal(config, 2) is None  # the last stage runs the teacher per microbatch
    config.parallelism.pipeline_parallel_degree, config.parallelism.context_parallel_degree = 1, 2
    assert (refusal(config, 2) or "").startswith(
        "distill.teacher_path with parallelism.context_parallel_degree=2 is not supported yet"
    )


def test_packed_chat_data_runs_under_context_parallel(tmp_path):
    from titanlab.data.prepare_chat import prepare_chat
    from titanlab.data.tokenizer import default_tokenizer_path

    jsonl = tmp_path / "chats.jsonl"
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    jsonl.write_text("\n".join(json.dumps({"messages": turn}) for _ in range(4)) + "\n")
    prepare_chat([str(jsonl)], str(tmp_path / "sft"), default_tokenizer_path(), progress=False)
    config = JobConfig()
    config.data.dataset_path = str(tmp_path / "sft")
    config.parallelism.context_parallel_degree = 2
    assert refusal(config, 2) is None  # packed samples: a document mask under CP


def test_context_parallel_mode_and_balancer_names_are_checked_in_one_line():
    from titanlab.config.manager import build_config

    with pytest.raises(ConfigError) as e:
        build_config(["--parallelism.context_parallel_load_balancer", "lpt"])
    assert str(e.value) == (
        "parallelism.context_parallel_load_balancer='lpt' is not valid; valid: auto, work, "
        "head_tail, none"
    )
    # auto, the default, is the mode's: work under ring, none under Ulysses
    ring = build_config([])
    ulysses = build_config(["--parallelism.context_parallel_mode", "ulysses"])
    assert (ring.parallelism.cp_load_balancer, ulysses.parallelism.cp_load_balancer) == (
        "work",
        "none",
    )
    with pytest.raises(ConfigError, match="valid: ring, ulysses; did you mean 'ring'"):
        build_config(["--parallelism.context_parallel_mode", "ring2"])
