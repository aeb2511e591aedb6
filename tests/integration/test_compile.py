"""torch.compile (per block, fullgraph) trains to the eager losses under FSDP 2, FSDP 2 × TP 2
and PP 2 × FSDP 2, and for Qwen3 (q/k norms sharded on heads) under TP 2 with selective
activation checkpointing, and Qwen3-MoE (dense parts compiled, experts eager) under EP 2 × FSDP 2
with selective AC, DeepSeek-V3 (multi-head latent attention) under TP 2 × EP 2 with full AC, and
gpt-oss (sinks, sliding windows) under TP 2 × EP 2 with selective AC.
CI leaves out the Llama FSDP 2 × TP 2, PP 2 × FSDP 2 and the MoE cases (compile meets FSDP in the
first case and TP in the Qwen3 one; `make test-parity-full`, TITANLAB_PARITY_FULL=1, runs them),
and captures the two TP cases with aot_eager, leaving Inductor's numerics to the FSDP case
(Inductor for every case in the full run)."""

import pytest

from conftest import CI_COMPILE_BACKEND, full_only, read_metrics

COMMON = ["--training.steps", "5", "--checkpoint.enable", "false"]
"""Five steps of the debug flavors' first 2 blocks: the blocks are alike, so what compile does
to one shows in two."""


GPU_MOE_PATH = ["--model.name", "qwen3_moe", "--model.moe_grouped_mm", "on",
                "--training.mixed_precision_on_cpu", "true", "--activation_checkpoint.mode",
                "selective", "--activation_checkpoint.selective_ac_option", "op"]  # fmt: skip

EP2_CHUNKS = ["--parallelism.expert_parallel_degree", "2",
              "--parallelism.expert_capacity_factor", "4",
              "--parallelism.expert_dispatch_chunks", "2"]  # fmt: skip
"""EP 2 with the capacity exchange in 2 chunks."""

CASES = [
    (2, 2, []),
    pytest.param(
        4,
        4,
        ["--parallelism.tensor_parallel_degree", "2"],
        marks=full_only("in the Qwen3 FSDP 2 × TP 2 case; make test-parity-full runs it"),
    ),
    pytest.param(
        4,
        4,
        ["--parallelism.pipeline_parallel_degree", "2"],
        marks=full_only(
            "compile × PP 2 is in the feature-pair matrix; make test-parity-full runs it"
        ),
    ),
    (
        2,
        4,
        [
            "--model.name",
            "qwen3",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            *CI_COMPILE_BACKEND,
        ],
    ),
    # Dense TP × full AC: the checkpoint around the compiled inner block (`apply_compile`'s
    # inside_checkpoint; compiled around the checkpoint it stopped on a DeviceMesh, in
    # Dynamo's capture). CI captures the TP cases with aot_eager (Inductor's numerics are the
    # FSDP case's: 57 s for the Qwen3 case under Inductor, 2 cores); Inductor under
    # TITANLAB_PARITY_FULL=1.
    (
        2,
        4,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
            *CI_COMPILE_BACKEND,
        ],
    ),
    # MoE blocks: the norms and attention compiled, the experts eager (issue 29). CI meets
    # MoE × compile in the feature-pair matrix's covering rows.
    pytest.param(
        2,
        2,
        [
            "--model.name",
            "qwen3_moe",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
        marks=full_only(
            "MoE × compile is in the feature-pair matrix; make test-parity-full runs it"
        ),
    ),
    # The GPU's MoE path on the CPU's bf16 grouped GEMM (`model.moe_grouped_mm = "on"`), per-op
    # SAC: on one process the MoE block compiles whole (around its checkpoint); under EP 2 ×
    # FSDP 2 with the capacity exchange in 2 chunks the MoE layer stays eager
    # (`moe_compile_mode`), and it trains like eager either way.
    (1, 4, [*GPU_MOE_PATH, *CI_COMPILE_BACKEND]),
    (2, 2, [*GPU_MOE_PATH, *EP2_CHUNKS, *CI_COMPILE_BACKEND]),
    # ... and under full AC the MoE layer compiles too, in pieces around FSDP's hooks
    (
        2,
        2,
        [*GPU_MOE_PATH, "--activation_checkpoint.mode", "full", *EP2_CHUNKS, *CI_COMPILE_BACKEND],
    ),
    # ... and under DDP (ep 1: no exchange), in pieces too
    pytest.param(
        2,
        2,
        [
            *GPU_MOE_PATH,
            "--activation_checkpoint.mode",
            "full",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            *CI_COMPILE_BACKEND,
        ],
        marks=full_only("the pieces under data parallel: CI's EP 2 x FSDP 2 full-AC case"),
    ),
    # DeepSeek-V3: MLA's tensor-parallel hooks (replicated latent projections, the rotary
    # key's gradient summed over tp) inside compiled blocks, with full AC. Its routed
    # experts make it an MoE case: compiled numerics can flip a near-tied routing choice
    # (measured 2.6e-5 once in CI, within 1e-5 in another run; 0.022 in a run handed a
    # graph from inductor's on-disk cache compiled under another layout, which the trainer
    # no longer reads under TP: `apply_compile`), so CI leaves it out like the Qwen3-MoE case.
    pytest.param(
        2,
        4,
        [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",  # its MTP depth trains: compiled and checkpointed like the layers
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
        marks=full_only("MoE × compile can flip a routing choice; make test-parity-full runs it"),
    ),
    # gpt-oss: sinks and the chunked sliding window (debugmodel: window 32, seq 64 here)
    # inside compiled blocks, its sinks split over tp; MoE, so with the MoE cases.
    pytest.param(
        2,
        4,
        [
            "--model.name",
            "gpt_oss",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
        marks=full_only("MoE × compile can flip a routing choice; make test-parity-full runs it"),
    ),
]
IDS = [
    "fsdp2",
    "fsdp2_tp2",
    "pp2_fsdp2",
    "qwen3_tp2_selective_ac",
    "llama3_tp2_full_ac",
    "moe_ep2_fsdp2_sac",
    "moe_whole_1proc_op_sac",
    "moe_gpu_path_ep2_fsdp2_chunks_op_sac",
    "moe_gpu_path_ep2_fsdp2_chunks_full_ac",
    "moe_gpu_path_ddp2_full_ac",
    "deepseek_v3_tp2_ep2_full_ac",
    "gpt_oss_tp2_ep2_sac",
]
CELLS = {
    "fsdp2": ["compile×dp_shard"],
    "fsdp2_tp2": ["compile×dp_shard", "compile×tp"],
    "pp2_fsdp2": ["compile×dp_shard", "compile×pp"],
    "qwen3_tp2_selective_ac": ["compile×tp"],
    "llama3_tp2_full_ac": ["compile×tp", "ac:full"],
    "moe_ep2_fsdp2_sac": ["compile×dp_shard", "compile×ep"],
    "moe_whole_1proc_op_sac": ["ac:selective-op"],
    "moe_gpu_path_ep2_fsdp2_chunks_op_sac": ["compile×dp_shard", "compile×ep", "ep-capacity×ep"],
    "moe_gpu_path_ep2_fsdp2_chunks_full_ac": ["compile×dp_shard", "compile×ep", "ac:full"],
    "moe_gpu_path_ddp2_full_ac": ["compile×dp_replicate", "ac:full"],
    "deepseek_v3_tp2_ep2_full_ac": ["compile×tp", "compile×ep", "ac:full"],
    "gpt_oss_tp2_ep2_sac": ["compile×tp", "compile×ep"],
}
"""The cover cells (tests/coverage_spec.py) of each case."""


def _params() -> list:
    out = []
    for case, name in zip(CASES, IDS, strict=True):
        values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
        out.append(pytest.param(*values, marks=(*marks, pytest.mark.cover(*CELLS[name])), id=name))
    return out


@pytest.mark.parametrize("nproc, local_batch, extra", _params())
def test_compiled_matches_eager(nproc, local_batch, extra, train, tmp_path):
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    args = [*COMMON, "--training.local_batch_size", str(local_batch), *extra]
    train(nproc, *args, dump=eager).check()
    run = train(nproc, *args, "--compile.enable", "true", dump=compiled).check()
    assert "compile: enable=true" in run.stdout  # the compact config shows compile on
    # the GPU's path: the MoE blocks compile whole on one process; under FSDP in pieces, but
    # under per-op SAC (the attention and norms alone)
    gpu_path, log = "--model.moe_grouped_mm" in extra, run.stdout + run.stderr
    modes = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--activation_checkpoint.mode"]
    ac_mode = modes[-1] if modes else ""
    assert ("MoE blocks compiled whole" in log) == (gpu_path and nproc == 1)
    pieces = gpu_path and nproc > 1 and ac_mode == "full"
    assert ("MoE blocks compiled in pieces" in log) == pieces
    a, b = read_metrics(eager), read_metrics(compiled)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    if "--training.mixed_precision_on_cpu" in extra:
        # bf16: the first step's loss within 1e-5 of eager's under aot_eager (equal on one
        # process, 1e-6 off under FSDP), within 5e-4 under Inductor, whose fused kernels round
        # bf16 otherwise (measured: 1.7e-4 of 8.97 at EP 2 × FSDP 2); the updates' bf16
        # gradients round apart (measured: 1.2e-3 by step 5 of losses near 8.3, 1.4e-4
        # relative; under per-op SAC the MoE layer compiled in pieces was 0.13 off by step 4
        # with Inductor, which is why `moe_compile_mode` leaves it eager there)
        assert abs(a[1] - b[1]) <= (1e-5 if CI_COMPILE_BACKEND else 5e-4), (a, b)
        assert max(abs(a[s] - b[s]) for s in a) <= 5e-3, (a, b)
        return
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5
