"""float8 for the routed experts (`float8.grouped_experts`, torchao's float8 rowwise grouped
GEMM): which weights it wraps, what it refuses in one line, and the step a GPU would run, as the
ledger records it on fake tensors with torchao's Triton kernels stood in."""

from __future__ import annotations

import collections
import dataclasses
import os

import pytest
import torch

from titanlab.config.device_path import Target, code_path_of
from titanlab.config.job_config import ConfigError, Float8
from titanlab.models.registry import build_model, get_family
from titanlab.precision.float8_experts import GROUP_MULTIPLE, apply_float8_experts

pytest.importorskip("torchao")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOPPER = Target("cuda", (9, 0))
ON = Float8(enable=True, grouped_experts=True)
FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"


def meta_model(family: str, flavor: str = "debugmodel"):
    args = dataclasses.replace(get_family(family).flavors[flavor], vocab_size=256)
    with torch.device("meta"):
        return build_model(args)


def test_the_experts_weights_and_only_they_are_wrapped_for_torchaos_grouped_gemm():
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    model = meta_model("qwen3_moe")
    with code_path_of(HOPPER):
        converted = apply_float8_experts(model, ON, torch.device("cpu"))
    wrapped = {n for n, p in model.named_parameters()
               if isinstance(p.data, Float8TrainingWeightWrapperTensor)}  # fmt: skip
    layers = model.args.n_layers
    assert converted == layers
    assert wrapped == {f"layers.{i}.feed_forward.experts.{w}"
                       for i in range(layers) for w in ("w1", "w2", "w3")}  # fmt: skip
    assert {m.group_multiple for m in model.modules() if hasattr(m, "group_multiple")} == {
        GROUP_MULTIPLE
    }


def test_off_by_default_and_a_no_op_when_off():
    model = meta_model("qwen3_moe")
    assert apply_float8_experts(model, Float8(enable=True), torch.device("cpu")) == 0


@pytest.mark.parametrize(
    "family, where, expected",
    [
        ("qwen3_moe", None, "needs a GPU with float8 (compute capability >= 8.9)"),
        ("llama3", HOPPER, "needs SwiGLU grouped experts (the model is dense)"),
        ("gpt_oss", HOPPER, "gpt-oss's clamped experts are not covered"),
    ],
)
def test_what_it_cannot_run_is_refused_in_one_line(family, where, expected):
    model = meta_model(family)
    with code_path_of(where) if where else torch.device("meta"), pytest.raises(ConfigError) as e:
        apply_float8_experts(model, ON, torch.device("cpu"))
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert "float8.grouped_experts" in str(e.value)


def test_grouped_experts_without_float8_is_refused():
    with pytest.raises(ValueError, match="float8.grouped_experts=true needs float8.enable=true"):
        Float8(grouped_experts=True).validate()


def ledger(*options: str, config: str = "qwen3_moe_debug.toml"):
    from titanlab.ledger.run import build_ledger

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", config), *options]
    return build_ledger(argv, "h100")


def test_the_gpu_step_runs_every_expert_gemm_in_float8_rowwise_with_the_kernels_stood_in():
    """The debug model on 2 fake ranks, FSDP 2 and EP 2: torchao's wrapper goes through expert
    parallel's Shard(0) and FSDP's all-gather; every grouped GEMM of the experts is torchao's
    float8 rowwise one on groups padded to 16 rows; each of its quantizations is one stood-in
    kernel; and every gate of the ledger still passes."""
    from titanlab.ledger.gates import check

    led = ledger("--comm.fake_world_size", "2", "--parallelism.expert_parallel_degree", "2",
                 "--float8.enable", "true", "--float8.grouped_experts", "true")  # fmt: skip
    experts = [op for op in led.ops if op.module.endswith("experts")]
    gemms = [op for op in experts if op.kind == "gemm"]
    assert {op.op for op in gemms} == {"aten._scaled_grouped_mm.default"}
    assert all(op.rowwise and op.dtype == "float8_e4m3fn" for op in gemms)
    forward = [op for op in gemms if op.phase == "forward"]
    args = get_family("qwen3_moe").flavors["debugmodel"]
    assert len(forward) == 3 * args.n_layers and len(gemms) == 3 * len(forward)  # dgrad, wgrad
    rows = {op.flops // (2 * args.dim * args.moe.hidden_dim) for op in forward}
    assert all(r % GROUP_MULTIPLE == 0 for r in rows), rows  # the padded groups' rows
    kernels = collections.Counter((op.op.split(".")[1], op.phase) for op in experts
                                  if op.op.startswith("titanlab."))  # fmt: skip
    n = len(forward)
    assert kernels == {
        ("fp8_rowwise_2d_scale_and_cast", "forward"): n,  # the tokens
        ("fp8_colwise_3d_scale_and_cast", "forward"): n,  # the weights
        ("fp8_rowwise_2d_scale_and_cast", "backward"): n,  # the output gradient
        ("fp8_rowwise_3d_transpose_rhs", "backward"): n,  # the weights, transposed
        ("fp8_per_group_colwise_scales_dual", "backward"): n,  # both wgrad operands
    }
    assert check(led) == {}


@pytest.mark.skipif(not FULL, reason="make test-full: 2 ledgers at Qwen3-30B-A3B's width")
def test_qwen3_30b_a3b_experts_in_float8_on_the_ledger():
    """2 blocks of Qwen3-30B-A3B on 8 ranks, EP 8, compiled, full AC, capacity 1.25 in 2 chunks
    (the MoE A/B's pieces): the experts' GEMMs in float8 against bf16 (the dense linears stay
    bf16). Prints both steps; float8 fails no gate that bf16 passes (both fail
    `hidden_all_to_alls` here: docs/performance.md, the MoE rows) and has the same
    expert GEMM FLOPs (the capacity's groups are multiples of 16 rows: no padding)."""
    from titanlab.ledger.gates import check

    pieces = ("--comm.fake_world_size", "8", "--model.n_layers", "2", "--compile.enable", "true",
              "--compile.components", "model,loss", "--activation_checkpoint.mode", "full",
              "--parallelism.expert_capacity_factor", "1.25",
              "--parallelism.expert_dispatch_chunks", "2")  # fmt: skip
    bf16 = ledger(*pieces, config="qwen3_30b_a3b.toml")
    fp8 = ledger(*pieces, "--float8.enable", "true", "--float8.grouped_experts", "true",
                 "--float8.filter_fqns", "output,attention,router", config="qwen3_30b_a3b.toml")  # fmt: skip

    def expert_flops(led):
        return sum(
            op.flops for op in led.ops if op.module.endswith("experts") and op.kind == "gemm"
        )

    print(f"Qwen3-30B-A3B 2 blocks: bf16 experts {bf16.priced.step_s * 1e3:.1f} ms, "
          f"float8 experts {fp8.priced.step_s * 1e3:.1f} ms")  # fmt: skip
    assert set(check(fp8)) <= set(check(bf16))
    assert expert_flops(fp8) == expert_flops(bf16)
