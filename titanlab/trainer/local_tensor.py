"""Every rank of a small world simulated in one process with real numerics
(`comm.mode = "local_tensor"`), for debugging a layout without torchrun.

torch.distributed._local_tensor's `LocalTensorMode` holds each tensor as one tensor per rank
(a `LocalTensor`) and computes each collective from the ranks' shards. The `Trainer` runs
unchanged inside the mode over a fake process group of the world size
(`titanlab.distributed.init.init_fake_world`); the data loader runs outside it, since its
sampler's indices must stay plain integers.

What torch 2.13's local tensors take: tensor parallel (1D, sequence parallel, loss parallel)
with the plain loss.
Not FSDP2 or its `replicate` (they free and resize parameter storages, which a LocalTensor's
storage refuses: "Attempted to call resize_() on an invalid python storage"), nor pipeline
parallel (its point-to-point sends), context or expert parallel; a layout with any is refused
with one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.config.performance import fused_loss
from titanlab.distributed.parallel_dims import ParallelDims

MAX_WORLD = 8
"""Ranks simulated at most: every op runs once per rank in this one process."""


def check_layout(config: JobConfig, world_size: int) -> None:
    """Raise ConfigError (one line) for a world or layout local tensors cannot simulate."""
    if not 2 <= world_size <= MAX_WORLD:
        raise ConfigError(
            f"comm.mode=local_tensor simulates 2..{MAX_WORLD} ranks in one process, not "
            f"{world_size}; set NGPU or comm.fake_world_size in that range"
        )
    dims = ParallelDims.from_config(config.parallelism, world_size)
    unsupported = {
        "data parallel (FSDP2 and replicate free parameter storages, which torch 2.13's local "
        "tensors cannot resize)": dims.dp_shard * dims.dp_replicate > 1,
        "pipeline parallel": dims.pp > 1,
        "context parallel": dims.cp > 1,
        "expert parallel": dims.ep > 1,
        f"tensor_parallel_mode={config.parallelism.tensor_parallel_mode}": (
            config.parallelism.tensor_parallel_mode != "1d"
        ),
    }
    if dims.tp > 1 and fused_loss(config):
        unsupported[
            "the fused loss under tensor parallel (its vocabulary offset is an integer "
            "that differs by rank, which torch 2.13's local tensors lose in tensor "
            "arithmetic; set loss.fused_linear_cross_entropy=false)"
        ] = True
    for what, on in unsupported.items():
        if on:
            raise ConfigError(
                f"comm.mode=local_tensor does not simulate {what} (layout {dims}); it runs "
                "tensor parallel alone (tensor_parallel_degree = the world size) with the plain "
                "loss; run this layout with torchrun (comm.mode=default)"
            )


class _OutsideLocalTensors:
    """An iterable whose items are made with the local-tensor mode off."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode():
            it = iter(self.items)
        while True:
            with maybe_disable_local_tensor_mode():
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item


def run(config: JobConfig) -> int:
    """Train `config` with every rank simulated in this process; returns the exit code (0).

    Raises:
        ConfigError: the world size or layout cannot be simulated (`check_layout`).
    """
    from torch.distributed._local_tensor import LocalTensorMode

    from titanlab.trainer import Trainer, dry_run

    world = dry_run.world_size(config)
    check_layout(config, world)
    with LocalTensorMode(world):
        trainer = Trainer(config)
        trainer.loader = _OutsideLocalTensors(trainer.loader)
        trainer.train()
        trainer.close()
    return 0
