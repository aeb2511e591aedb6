"""One whole training step of a dry-run `Trainer` (comm.mode "fake_backend") on fake tensors,
recorded op by op (the second: the first builds the optimizer state): the trainer's own
`train_step` (every grad-accumulation microbatch's forward
and backward with the loss as configured, the gradient norm and clipping, the optimizer step),
as rank 0 of the fake world plays it, at the config's real shapes.

Compiled regions run eagerly (`torch.compiler.set_stance("force_eager")`, as the dry-run step:
Inductor's kernels cannot run on tensors without memory); the recorder marks them and the
pricing fuses their pointwise ops. Pipeline schedules are not recorded (they step real stages
only): `record_step` raises ConfigError for a pipelined layout. `record_loop` records any
loop's step this way (the trainer's here; the plain loop's and torchtitan's in `loop.py`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from titanlab.components.optim import LRSchedulersContainer, OptimizersContainer
from titanlab.config import host_reads
from titanlab.config.device_path import Target, code_path_of, target
from titanlab.config.job_config import ConfigError
from titanlab.data.batches import BatchPreparer
from titanlab.data.document_masking import DocumentMasking
from titanlab.ledger.gpu_kernels import gpu_attention
from titanlab.precision.float8_experts_stand_in import torchao_kernels_priced
from titanlab.ledger.record import OpRecord, Recorder


def group_dims(trainer: Any) -> dict[str, str]:
    """Process-group name → mesh dim name, for every named dim of the trainer's meshes."""
    out: dict[str, str] = {}
    dims = trainer.parallel_dims
    for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "efsdp", "dp_shard_cp", "dp"):
        mesh = dims.mesh(name)
        if mesh is not None and mesh.ndim == 1:
            out[mesh.get_group().group_name] = name
    return out


_CPU_READS = (("optimizer.py", "_get_value"), ("sharded_grad_scaler.py", "_amp_update_scale_cpu_"))
"""(file, function) of host reads a GPU run does not make: torch.optim's step counters
(`_get_value`), which a non-fused, non-capturable optimizer keeps on the CPU on a GPU too, and
FSDP's `ShardedGradScaler` updating its scale on its CPU branch (taken because the ledger's
tensors live on the CPU; on CUDA `torch._amp_update_scale_` reads nothing)."""


def _reads_a_cpu_tensor() -> bool:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if any(code.co_filename.endswith(f) and code.co_name == n for f, n in _CPU_READS):
            return True
        frame = frame.f_back
    return False


class HostReads(TorchDispatchMode):
    """Answers a host read of a fake tensor (`.item()`, `.tolist()`, `bool()`, `float()`: each
    value one `aten._local_scalar_dense`) with 1 of its dtype instead of failing, as fake
    tensors hold no values, and tells `recorder` (when given) of each read of what is a device
    tensor on the GPU: a host sync. Entered above the recorder, it keeps the op itself out of
    what is recorded. Not counted: the reads `_CPU_READS` names (CPU tensors on the GPU too).
    The loss scaler's overflow flag is not read here; `steady_state_scaler` counts its read."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(a) for a in tree_leaves((args, kwargs))):
            return NotImplemented  # DTensor & co. run their inner ops, which come here
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if self.recorder is not None and not _reads_a_cpu_tensor():
                self.recorder.host_read(str(func), args[0])
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return func(*args, **kwargs)


class DeviceToHost(TorchFunctionMode):
    """Tells `recorder` of each device-to-host copy the code asks for (`Tensor.cpu()`,
    `Tensor.numpy()`, `Tensor.to("cpu")` with the device named as the string): a host sync
    on the GPU, which fake tensors, living on the CPU, return without an op. A `.to(device)`
    with a `torch.device` is the trainer's move to its own device, which the ledger's trainer
    sets to the CPU in the GPU's place: not counted."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) or (
            func is torch.Tensor.to and _names_the_cpu(args[1:], kwargs)
        ):
            if isinstance(args[0], torch.Tensor):
                self.recorder.host_read(f"Tensor.{func.__name__}", args[0])
        return func(*args, **kwargs)


def _names_the_cpu(args: tuple, kwargs: dict) -> bool:
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def steady_state_scaler(scaler: Any) -> None:
    """float16's loss scaler (`torch.amp.GradScaler`, FSDP's `ShardedGradScaler`) as the
    ledger runs it: every op of its step (the loss scaled, the gradients unscaled and checked
    for inf/NaN, the flag all-reduced under FSDP, the scale updated), but the optimizer steps
    without reading the overflow flag (fake tensors hold none): a step without overflow, the
    steady state. The flag's reads a GPU run makes there (`.item()` of each device's flag, a
    host sync each) are counted (`titanlab.config.host_reads.skipped`)."""

    def step_without_reading(optimizer, optimizer_state, *args, **kwargs):
        for found_inf in optimizer_state["found_inf_per_device"].values():
            host_reads.skipped("GradScaler.found_inf", found_inf)
        return optimizer.step(*args, **kwargs)

    scaler._maybe_opt_step = step_without_reading


def record_loop(
    build: Callable[[], Callable[[], Any]], target: Target, compile_backend: str = "inductor"
) -> list[OpRecord]:
    """The ops of one step of a loop on `target`'s code path. `build()` runs under
    `FakeTensorMode` (the model, optimizer and batch it makes are fake tensors: build them on
    the CPU) and returns the step; the step runs twice and the second is recorded (the first
    builds the optimizer state). Compiled modules run eagerly, as in the trainer's ledger, and
    are fused regions when `compile_backend` is Inductor. Host syncs are recorded (kind
    "sync": `HostReads`, `DeviceToHost`)."""
    attention = gpu_attention(target) if target.type == "cuda" else contextlib.nullcontext()
    recorder = Recorder(compile_backend)
    with (
        code_path_of(target),
        attention,
        torchao_kernels_priced(),
        torch.compiler.set_stance("force_eager"),
        FakeTensorMode(allow_non_fake_inputs=True),
        HostReads(),
    ):
        step = build()
        step()
        # above the recorder: a read is not an op it records, but a host sync it counts
        with recorder, HostReads(recorder), DeviceToHost(recorder):
            step()
    return recorder.ops


def record_step(trainer: Any) -> list[OpRecord]:
    """The ops rank 0 runs in one optimizer step of `trainer` (built with comm.mode
    "fake_backend", before any weight is loaded). Raises ConfigError for a pipelined layout."""
    from titanlab.distributed.parallelize import param_dtype
    from titanlab.peft.qlora import to_empty_keeping_quantized

    if trainer.schedule is not None:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree="
            f"{trainer.parallel_dims.pp}: the ledger records steps without pipeline stages; "
            "use pipeline_parallel_degree=1"
        )
    config = trainer.config
    compute_dtype = param_dtype(config, torch.device(trainer.dry_run.device_type))
    # What a dry-run Trainer leaves out: the batch preparer (document masking as configured;
    # the EOS id does not change a shape) and the step count.
    masking = None
    if config.data.document_mask:
        masking = DocumentMasking(eos_id=1, reset_positions=config.data.reset_positions)
    trainer.batches = BatchPreparer(config, masking, rank=0, dp_rank=0)
    if config.parallelism.cp_load_balancer == "work":
        # The work balancer reads the documents' lengths, which fake tensors do not hold; the
        # head-tail order gives each rank as many tokens, all the ledger's shapes depend on.
        config.parallelism.context_parallel_load_balancer = "head_tail"
    trainer.step = 1
    trainer.device = torch.device("cpu")  # where the fake tensors live (the meta device's stand-in)
    trainer.init_step_state(compute_dtype)
    if trainer.scaler is not None:  # float16
        steady_state_scaler(trainer.scaler)
    mb, seq = config.training.local_batch_size, config.training.seq_len
    accum = trainer.batch.grad_accum_steps

    def build():  # under the fake mode `record_loop` enters
        for part in trainer.model_parts:
            to_empty_keeping_quantized(part, "cpu")
        # Materializing replaced the parameters that are not DTensors (a run without FSDP or
        # TP): the optimizer is built again on the model's own.
        trainer.optimizer = OptimizersContainer(
            trainer.model_parts,
            config.optimizer,
            trainer.device,
            allow_fused=compute_dtype != torch.float16,
        )
        trainer.lr_scheduler = LRSchedulersContainer(
            trainer.optimizer, config.lr_scheduler, config.training.steps
        )
        batches = [(torch.zeros(mb, seq, dtype=torch.long),) * 2 for _ in range(accum)]
        return lambda: trainer.train_step(batches)

    return record_loop(build, target() or Target("cpu"), config.compile.backend)
