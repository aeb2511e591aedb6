"""torchtitan 0.2.2's training step for the per-op ledger (gate 4, docs/ledger.md): its own
Llama 3 model, float8 converter, `parallelize_llama` (activation checkpointing, per-block
torch.compile), loss, optimizers, gradient clipping and autocast, stepped in the order of its
`Trainer.train_step` (forward and loss under autocast, backward, `clip_grad_norm_`, optimizer
step), on one device, built on fake tensors so `titanlab.ledger.loop` records and prices it as
it does titanlab's trainer. A peer, for benchmarks and tests only: titanlab never imports it.

What the harness supplies where torchtitan's `Trainer` would: fake tensors instead of a CUDA
device (its CPU shim, `tools/lib/torchtitan_cpu.py`), no weight initialization (fake tensors
hold no values), the float8 capability check answered for the target GPU, and its compiled
blocks and loss made regions the ledger sees (`as_module_compile`; `compile_function`, the same
torch.compile of its `cross_entropy_loss`), and, for FSDP, a fake world of `dp_shard` ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """Llama 3's dims (torchtitan's `TransformerModelArgs` names) and the batch."""

    dim: int = 4096
    n_layers: int = 2
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim_multiplier: float = 1.3
    multiple_of: int = 1024
    vocab_size: int = 128256
    seq_len: int = 8192
    local_batch: int = 1


@contextlib.contextmanager
def float8_capable() -> Iterator[None]:
    """torchtitan's float8 converter asks the local CUDA device for compute capability 8.9;
    on the ledger's path the target GPU (an H100) has it."""
    import torchtitan.components.quantization.float8 as float8

    before = float8.has_cuda_capability
    float8.has_cuda_capability = lambda major, minor: True
    try:
        yield
    finally:
        float8.has_cuda_capability = before


@contextlib.contextmanager
def as_module_compile() -> Iterator[None]:
    """torchtitan's `apply_compile` wraps each block in `torch.compile(block)` (an
    `OptimizedModule`), inside which torch's `ModTracker` records no module; inside this
    context it compiles each block in place instead, `block.compile(backend, fullgraph=True)`:
    the same compile, which the ledger sees as a compiled region with its module paths (torch's
    own warning about global module hooks recommends it), and which FSDP then wraps as it
    wraps the OptimizedModule (AC, compile, FSDP: `parallelize_llama`'s order is kept)."""
    import torchtitan.models.llama3.infra.parallelize as parallelize

    def apply_compile(model: torch.nn.Module, compile_config) -> None:
        for block in model.layers.children():  # type: ignore[union-attr]
            block.compile(backend=compile_config.backend, fullgraph=True)

    before = parallelize.apply_compile
    parallelize.apply_compile = apply_compile
    try:
        yield
    finally:
        parallelize.apply_compile = before


class StepBuilder:
    """`build()` makes torchtitan's step (the builder `titanlab.ledger.step.record_loop` takes);
    `group_dims()`, once built, names its process groups by mesh dim, as
    `titanlab.ledger.step.group_dims` names titanlab's."""

    def __init__(self, build: Callable[[], Callable[[], None]], dims_of: Callable[[], dict]):
        self.build, self.group_dims = build, dims_of

    def __call__(self) -> Callable[[], None]:
        return self.build()


def step_builder(shape: Shape, titan_args: list[str], dp_shard: int = 1) -> StepBuilder:
    """A builder for `titanlab.ledger.loop.record_loop`: torchtitan's step of `shape` with its
    command-line options `titan_args` (compile, activation checkpointing, float8), on one
    device or, with `dp_shard` > 1, as rank 0 of FSDP over `dp_shard` ranks (its
    `parallelize_llama` applies FSDP2 over the default process group, which the caller makes
    a fake world of that size: `titanlab.distributed.init.init_fake_world`)."""
    from tools.lib.torchtitan_cpu import use_cpu

    use_cpu()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.protocols.model_converter import build_model_converters

    from titanlab.components.compiled import compile_function

    config = ConfigManager().parse_args([
        "--training.seq_len", str(shape.seq_len),
        "--training.local_batch_size", str(shape.local_batch),
        "--training.max_norm", "1.0", *titan_args,
    ])  # fmt: skip
    args = TransformerModelArgs(
        dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab_size,
        ffn_dim_multiplier=shape.ffn_dim_multiplier, multiple_of=shape.multiple_of,
        rope_theta=500000, max_seq_len=shape.seq_len,
    )  # fmt: skip

    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=dp_shard)  # fmt: skip
    if dp_shard > 1:  # its meshes, built here: `build` runs under the fake tensor mode
        dims.build_mesh()

    def build() -> Callable[[], None]:
        with torch.device("cpu"):
            model = Transformer(args)
        with float8_capable():
            build_model_converters(config, dims).convert(model)
        with as_module_compile():
            model = parallelize_llama(model, dims, config)
        loss_fn = cross_entropy_loss
        if config.compile.enable and "loss" in config.compile.components:
            loss_fn = compile_function(cross_entropy_loss)
        optimizers = build_optimizers([model], config.optimizer, dims)
        params = list(model.parameters())
        tokens = torch.zeros(shape.local_batch, shape.seq_len, dtype=torch.long)
        amp = dist_utils.maybe_enable_amp(dims, config.training.mixed_precision_param, "cpu")

        def step() -> None:
            optimizers.zero_grad()
            with amp:
                pred = model(tokens)
                loss = loss_fn(pred, tokens) / tokens.numel()
            del pred
            loss.backward()
            dist_utils.clip_grad_norm_(params, config.training.max_norm, foreach=True)
            optimizers.step()

        return step

    def group_dims() -> dict[str, str]:
        if dp_shard == 1:
            return {}
        return {dims.get_mesh("fsdp").get_group().group_name: "dp_shard"}

    return StepBuilder(build, group_dims)
