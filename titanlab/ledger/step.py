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
from collections.abc import Callable
from typing import Any

import torch

from titanlab.components.optim import LRSchedulersContainer, OptimizersContainer
from titanlab.config.device_path import Target, code_path_of, target
from titanlab.config.job_config import ConfigError
from titanlab.data.batches import BatchPreparer
from titanlab.data.document_masking import DocumentMasking
from titanlab.ledger.gpu_kernels import gpu_attention
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


def record_loop(build: Callable[[], Callable[[], Any]], target: Target) -> list[OpRecord]:
    """The ops of one step of a loop on `target`'s code path. `build()` runs under
    `FakeTensorMode` (the model, optimizer and batch it makes are fake tensors: build them on
    the CPU) and returns the step; the step runs twice and the second is recorded (the first
    builds the optimizer state). Compiled modules run eagerly, as in the trainer's ledger."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = gpu_attention(target) if target.type == "cuda" else contextlib.nullcontext()
    recorder = Recorder()
    with (
        code_path_of(target),
        attention,
        torch.compiler.set_stance("force_eager"),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        step = build()
        step()
        with recorder:
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
    if config.parallelism.context_parallel_load_balancer == "work":
        # The work balancer reads the documents' lengths, which fake tensors do not hold; the
        # head-tail order gives each rank as many tokens, all the ledger's shapes depend on.
        config.parallelism.context_parallel_load_balancer = "head_tail"
    trainer.step = 1
    trainer.device = torch.device("cpu")  # where the fake tensors live (the meta device's stand-in)
    trainer.init_step_state(compute_dtype)
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

    return record_loop(build, target() or Target("cpu"))
