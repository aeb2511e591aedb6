"""Every place titanlab reads a device's type is either on the ledger's code path (it asks
`titanlab.config.device_path`, so the ledger's fake CPU tensors take the target GPU's branch) or
listed here with the reason it is not; a new one fails until it is one or the other. And the
switch itself: inside `code_path_of`, the fused loss's weight gradient takes the GPU's bf16
product."""

from __future__ import annotations

import torch

from titanlab.config.device_path import Target, code_path_of, device_capability, device_type
from tests.unit.config.device_branches import device_branches

THIS_MACHINE = "measures, profiles or manages this machine's own device, not a step's path"
PLANNED = "compares a device_type argument its callers pass from the dry run's target"
OUTSIDE_STEP = "runs outside a training step (start-up, initialization, a CLI)"
NOT_BRANCHING = (
    "passes the tensors' own device type to autocast: on the ledger's fake CPU tensors "
    "autocast computes in the same dtype"
)
LIGER = (
    "Liger's Triton kernels need a CUDA runtime; the ledger prices PyTorch's unfused ops for "
    "kernels.liger=true (docs/ledger.md, limits)"
)
OFFLOAD = "CUDA streams; activation offload is not priced yet (docs/ledger.md, limits)"
CP = (
    "context parallel on the ledger runs the CPU ring (its GPU path needs CUDA's SDPA "
    "kernels); docs/ledger.md, limits"
)
PINNED = "pinned host memory for CPU offload (a CUDA runtime call), no kernel choice"
FLEX = (
    "tells a GPU step priced on CPU tensors (the ledger, the memory estimator) from a real one, "
    "to run FlexAttention's priced stand-in; the kernel choice is `attention_masks`', through "
    "the switch"
)
FLA = (
    "flash-linear-attention's Triton kernel runs on real GPU tensors only: a GPU step priced "
    "on CPU tensors runs (and the ledger prices) PyTorch's chunked delta rule; docs/ledger.md, "
    "limits"
)
FLOAT8 = "names the device in a refusal (`float8_supported` decides)"
AUTOCAST = (
    "asks whether autocast is on for the device it was entered for (the trainer's, the same "
    "under the ledger); the kernel choice is `grouped_mm_supported`'s, through the switch"
)

_LISTED = {
    "config/device_path.py": {"_type_of": "the switch itself",
                              "device_capability": "the switch itself"},
    "components/builders.py": {"init_model_weights": OUTSIDE_STEP},
    "components/liger.py": {"check_liger": LIGER},
    "data/loader.py": {"build_dataloader": THIS_MACHINE},
    "distributed/activation_offload.py": {
        "OffloadSavedTensors.__init__": OFFLOAD, "OffloadSavedTensors._pack": OFFLOAD,
        "apply_offload": OUTSIDE_STEP, "check_offload": OUTSIDE_STEP,
    },
    "distributed/context_parallel/torch_sdpa.py": {"cp_context": CP},
    "distributed/init.py": {"device_type": THIS_MACHINE},
    "distributed/parallelize.py": {"parallelize_model": PINNED},
    "generation/cli.py": {"run": OUTSIDE_STEP},
    "metrics/flops.py": {"device_peak_flops": THIS_MACHINE},
    "metrics/system.py": dict.fromkeys(("memory_fields", "memory_kind", "reset_peaks"),
                                       THIS_MACHINE),
    "models/common/flex_kernel.py": {"flex_call": FLEX},
    "models/common/delta_rule_kernel.py": {"chunked_rule": FLA},
    "models/common/experts.py": {"matmul_dtype": AUTOCAST},
    "models/common/moe.py": {"Router.forward": NOT_BRANCHING},
    "observability/profiling.py": dict.fromkeys(
        ("StepProfiler.__enter__", "StepProfiler.__init__", "StepProfiler._window_done",
         "StepProfiler.step", "live_tensor_bytes"), THIS_MACHINE),
    "observability/warning_filters.py": {"install": THIS_MACHINE},
    "planning/calibrate.py": dict.fromkeys(
        ("_link", "_link_worker.timed", "_seconds", "calibrate"), THIS_MACHINE),
    "planning/calibrate_fsdp.py": dict.fromkeys(
        ("fsdp_step_seconds", "fsdp_step_seconds.timed"), THIS_MACHINE),
    "planning/calibrate_tp.py": dict.fromkeys(
        ("tp_block_seconds", "tp_block_seconds.timed"), THIS_MACHINE),
    "planning/cluster.py": {"profile_of_this_machine": THIS_MACHINE},
    "planning/cp_memory.py": {"cp_attention_bytes": PLANNED},
    "planning/memory.py": {"available_bytes_per_rank": THIS_MACHINE, "check_memory": THIS_MACHINE,
                           "estimate_memory": PLANNED},
    "planning/report.py": {"preflight_summary": THIS_MACHINE},
    "planning/perf_model.py": {"_set_exposed": PLANNED},
    "planning/planner.py": {"run_of": PLANNED},
    "planning/preflight.py": {"check": PLANNED},
    "planning/validate.py": {"validate_layout": PLANNED},
    "posttrain/teacher.py": {"build_teacher": OUTSIDE_STEP},
    "precision/float8.py": {"apply_float8": FLOAT8},
    "precision/mixed.py": {"autocast_context": NOT_BRANCHING, "build_grad_scaler": NOT_BRANCHING},
    "trainer/trainer.py": {"Trainer.__init__": THIS_MACHINE},
}  # fmt: skip
NOT_ON_THE_LEDGERS_PATH: dict[tuple[str, str], str] = {
    (f"titanlab/{path}", function): why
    for path, functions in _LISTED.items()
    for function, why in functions.items()
}
"""(file, function) of every device branch not on the ledger's path, with the reason."""


def test_every_device_branch_goes_through_the_switch_or_says_why_not():
    found = device_branches()
    unlisted = sorted(found - NOT_ON_THE_LEDGERS_PATH.keys())
    assert not unlisted, (
        "these read a device's type directly: ask titanlab.config.device_path.device_type / "
        f"device_capability instead, or list them here with the reason: {unlisted}"
    )
    gone = sorted(NOT_ON_THE_LEDGERS_PATH.keys() - found)
    assert not gone, f"listed but no longer reading a device's type (drop them): {gone}"


def test_the_switch_answers_for_the_target_inside_and_for_the_tensor_outside():
    x = torch.zeros(2)
    assert device_type(x) == "cpu" and device_capability(x) == (0, 0)
    with code_path_of(Target("cuda", (9, 0))):
        assert device_type(x) == "cuda" and device_type(torch.device("meta")) == "cuda"
        assert device_capability(x) == (9, 0)
    assert device_type("cpu") == "cpu"


def test_on_the_gpus_path_the_fused_losss_weight_gradient_is_a_bf16_product():
    """The defect of 2026-11-27: on an accelerator the head's weight gradient was summed as
    fp32 GEMMs; on the GPU's path the product runs in bf16 and is added to the fp32 sum."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanlab.components.head_gradient import product
    from titanlab.ledger.record import Recorder

    def gemm_dtypes(operands: torch.dtype, compute: torch.dtype | None = None) -> list[str]:
        with FakeTensorMode():
            a, b = torch.empty(64, 8, dtype=operands), torch.empty(8, 16, dtype=operands)
            rec = Recorder()
            with rec:
                product(a, b, compute or operands)
        return [op.dtype for op in rec.ops if op.kind == "gemm"]

    assert gemm_dtypes(torch.bfloat16) == ["float32"]  # CPU: one fp32 GEMM
    with code_path_of(Target("cuda", (9, 0))):
        assert gemm_dtypes(torch.bfloat16) == ["bfloat16"]
        # one GPU under autocast: fp32 weights and hidden states, the logits GEMM in bf16
        assert gemm_dtypes(torch.float32, torch.bfloat16) == ["bfloat16"]
        assert gemm_dtypes(torch.float32) == ["float32"]  # fp32 training stays fp32
