"""A dry run at the real world size (`comm.mode = "fake_backend"`): one process plays rank 0.

torchtitan's `COMM_MODE=fake_backend` answers "will this config start on 256 GPUs?" without the
GPUs; this is titanlab's. The `Trainer` runs its real start-up on PyTorch's fake process group
(`titanlab.distributed.init.init_fake_world`): the pre-flight against the memory of
`comm.dry_run_device` (an H100 by default, not this machine's), the device mesh, the model on
the meta device, float8 / LoRA / the fused loss, `parallelize_model` or the pipeline split and
schedule, the optimizer and the LR schedule; it stops before the checkpointer would load or
initialize weights. `report` then builds the optimizer state and the DCP save plan of the
sharded state (on meta tensors: no bytes exist) and prints what rank 0 holds.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanlab.config.device_path import target as code_path_target
from titanlab.config.job_config import ConfigError, Float8, JobConfig
from titanlab.planning.cluster import Cluster, get_profile
from titanlab.planning.memory import GIB


def target(config: JobConfig) -> Cluster | None:
    """The cluster profile a dry run plans for (`comm.dry_run_device`), or None outside a dry
    run. Raises ConfigError (one line) for an unknown profile."""
    if config.comm.mode != "fake_backend":
        return None
    return get_profile(config.comm.dry_run_device)


def world_size(config: JobConfig) -> int:
    """Ranks of the run: a simulated world's (comm.mode "fake_backend" or "local_tensor")
    `$NGPU` when set, else its `comm.fake_world_size`; a real run's `$WORLD_SIZE` (torchrun's, 1
    without it). Raises ConfigError when a simulated world has neither, or NGPU is not a whole
    number >= 1."""
    mode = config.comm.mode
    if mode == "default":
        return int(os.environ.get("WORLD_SIZE", "1"))
    ngpu = os.environ.get("NGPU")
    if ngpu is not None:
        if not ngpu.isdigit() or int(ngpu) < 1:
            raise ConfigError(f"NGPU={ngpu!r} must be a whole number >= 1")
        return int(ngpu)
    if config.comm.fake_world_size >= 1:
        return config.comm.fake_world_size
    raise ConfigError(
        f"comm.mode={mode} needs the world size to simulate: set NGPU=<ranks> or "
        "--comm.fake_world_size <ranks>"
    )


def float8(config: JobConfig, device: Cluster | None) -> Float8:
    """The float8 config the model is built with: a dry run on meta tensors builds torchao's
    emulated Linears (the same modules, float8 math in software) when the target device has
    float8, except on a target's code path (`titanlab.ledger`), which takes the GPU's float8
    GEMMs (`torch._scaled_mm`, which fake tensors run). Raises ConfigError when it has none."""
    cfg = config.float8
    if device is None or not cfg.enable:
        return cfg
    if "float8" not in device.peak_flops:
        raise ConfigError(
            f"float8.enable=true needs float8 hardware; comm.dry_run_device="
            f"{config.comm.dry_run_device} ({device.name}) has none; choose h100, h200 or b200"
        )
    return cfg if code_path_target() is not None else dataclasses.replace(cfg, emulate=True)


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """What rank 0 holds after start-up, in bytes (its own shards of its own stages)."""

    params: int
    grads: int
    """Gradients as sharded as their parameters, in the parameters' dtype."""
    optimizer: int
    """The optimizer state once built (AdamW: two moments and a step count per parameter)."""
    save_items: int
    """Entries rank 0 writes in the DCP save plan of the model and optimizer state."""
    save_bytes: int
    """Bytes of those entries' tensors."""


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def rank_bytes(trainer: Any) -> RankBytes:
    """Rank 0's parameter, gradient and optimizer bytes and its DCP save plan, read from the
    model parts and optimizer of `trainer` (a `Trainer` built with comm.mode "fake_backend":
    meta tensors, shapes and dtypes only)."""
    params = [p for part in trainer.model_parts for p in part.parameters()]
    trained = [p for p in params if p.requires_grad]
    state: dict[str, Any] = {}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(trainer.model_parts, trainer.optimizer.optimizers):
        # The state built one tensor at a time (the same state as the foreach step's): DTensor
        # propagates a foreach op's sharding over all its tensors at once, minutes for the
        # thousands of a 235B MoE; per tensor its cache answers (2 s).
        for group in opt.param_groups:
            group["foreach"] = group["fused"] = False
        state.update({f"model.{k}": v for k, v in get_model_state_dict(part).items()})
        # builds the optimizer state as a checkpoint save does (a step with zero gradients)
        optim = get_optimizer_state_dict(part, opt, options=flat)
        state.update({f"optimizer.{k}": v for k, v in optim.items()})
    optimizer = sum(
        _local_bytes(v)
        for k, v in state.items()
        if k.startswith("optimizer.") and isinstance(v, torch.Tensor)
    )
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    tensors = [state[item.index.fqn] for item in plan.items]
    return RankBytes(
        params=sum(_local_bytes(p) for p in params),
        grads=sum(_local_bytes(p) for p in trained),
        optimizer=optimizer,
        save_items=len(plan.items),
        save_bytes=sum(_local_bytes(t) for t in tensors if isinstance(t, torch.Tensor)),
    )


def fake_step(trainer: Any) -> str:
    """One microbatch's forward and backward through the trainer's own `_forward_backward`
    (the loss, loss parallel, the fused head, MoE dispatch) on fake tensors: the model parts
    are materialized under `FakeTensorMode` (shapes only, no memory) and fed zeros. Returns one
    line: what ran, or why it did not (a pipeline schedule, or an op fake tensors cannot run,
    such as a data-dependent all-to-all split); call it after `rank_bytes`.

    Compiled regions (`compile.enable`) run eagerly here (`torch.compiler.set_stance
    ("force_eager")`): Inductor's CPU kernels, compiled for real tensors, read the memory of
    fake ones, which have none (the step died of a segmentation fault on every compiled
    config). The shapes, the layout's collectives and the loss are the same; what compiling
    changes (fusion, memory) is the estimate's to count."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanlab.components.loss import maybe_loss_parallel
    from titanlab.distributed.parallelize import param_dtype
    from titanlab.peft.qlora import to_empty_keeping_quantized

    if trainer.schedule is not None:
        return "forward/backward: not run (pipeline schedules step on real stages only)"
    config = trainer.config
    device = torch.device(trainer.dry_run.device_type)
    trainer.init_step_state(param_dtype(config, device))
    mb, seq = config.training.local_batch_size, config.training.seq_len
    compiled = " (compiled regions run eagerly)" if config.compile.enable else ""
    try:
        with torch.compiler.set_stance("force_eager"), FakeTensorMode(allow_non_fake_inputs=True):
            for part in trainer.model_parts:
                to_empty_keeping_quantized(part, "cpu")
            tokens = torch.zeros(mb, seq, dtype=torch.long)
            with maybe_loss_parallel(trainer.loss_parallel):
                trainer._forward_backward(tokens, tokens.clone(), torch.ones(()), {})
    except Exception as e:  # an op fake tensors cannot run: say which, do not fail the run
        return f"forward/backward: not run on fake tensors ({type(e).__name__}: {str(e)[:160]})"
    return f"forward/backward: ran on fake tensors (a microbatch of {mb} × {seq} tokens){compiled}"


def report(trainer: Any, held: RankBytes | None = None) -> str:
    """The dry run's summary: the layout, rank 0's bytes, the save plan and the pre-flight's
    estimate (the peak rank's) against the target device's memory. `held`: `rank_bytes(trainer)`
    when the caller has it already (its save plan takes seconds at 405B), else computed here."""
    device = trainer.dry_run
    assert device is not None, "report() follows a Trainer built with comm.mode=fake_backend"
    held = held if held is not None else rank_bytes(trainer)
    step = fake_step(trainer) if trainer.config.comm.dry_run_step else ""
    est = trainer.memory
    dims = trainer.parallel_dims
    stages = ""
    if dims.pp_enabled:
        stages = f" (pipeline rank 0: {len(trainer.model_parts)} stage(s))"
    lines = [
        f"dry run: world size {dims.world_size} on fake process groups, planned for "
        f"{device.name} ({device.memory_bytes / GIB:.1f} GiB each); layout: {dims}",
        f"rank 0 holds{stages}: params {held.params / GIB:.2f} GiB, grads "
        f"{held.grads / GIB:.2f} GiB, optimizer {held.optimizer / GIB:.2f} GiB",
        f"checkpoint: DCP save plan of rank 0, {held.save_items} items, "
        f"{held.save_bytes / GIB:.2f} GiB",
        f"memory estimate (peak rank): {est.total / GIB:.1f} GiB of "
        f"{device.memory_bytes / GIB:.1f} GiB ({est.summary()})",
        *([step] if step else []),
        "dry run: ok, nothing trained or written",
    ]
    return "\n".join(lines)
