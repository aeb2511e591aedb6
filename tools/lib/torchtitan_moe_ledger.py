"""torchtitan 0.2.2's Mixture-of-Experts step for the per-op ledger (issue 94's A/B): its own
Qwen3-MoE and DeepSeek-V3 models at a published flavor's dims, its `parallelize_qwen3` /
`parallelize_deepseekv3` (expert parallel over dp_shard, FSDP2 with the experts on `efsdp`,
activation checkpointing, its MoE compile weave), its optimizers (DeepSeek-V3's with the
expert-bias load balancing), loss, clipping and autocast, stepped as `Trainer.train_step` does
and recorded on fake tensors by `titanlab.ledger.loop`, as `tools/lib/torchtitan_ledger.py`
does for Llama 3. A peer, for benchmarks and tests only: titanlab never imports it.

What the harness supplies where a GPU would, each the least that fake tensors need:
- **The all-to-all splits.** torchtitan's `ExpertParallel._token_dispatch` copies both split
  lists to the host (`.to("cpu")`, the second blocking: one host sync a dispatch, counted) and
  reads them; fake tensors hold no values, so here the lists are a balanced router's, every
  rank's slots split evenly over the ranks (as titanlab's own exchange is priced).
- **Two GPU kernels.** torchtitan's triton `fill_indices` (a GPU build only) becomes an index
  tensor of its output's length, written once; its other outputs are torchtitan's own tensor
  code (`generate_permute_indices`' prefix sums and padding). `torch.histc` of the router's
  integer expert ids (CUDA's kernel takes integers, the CPU's fake kernel refuses them) is one
  scatter-add over the same elements.
- **Its compile weave in place.** `apply_compile` wraps each child of an MoE block (and each of
  the MoE's but the experts) in `torch.compile`, an `OptimizedModule` inside which the ledger
  sees no module; here each is compiled in place instead: `Module.compile` for torchtitan's
  modules, `titanlab.distributed.compile.compile_forward` for torch's norms (in which
  `Module.compile` finds no frame, while `torch.compile(norm)` compiles one). Dense blocks
  compile whole, in place. The same regions, the same order (AC, compile, FSDP).
- **torch 2.13's SAC replay count.** Per-op SAC over a block whose experts FSDP shards on
  their own fails in the recompute ("invocation index N ... not found in storage",
  pytorch/torchtitan#3427): FSDP's `record_function` ranges run a different number of times
  there. The harness keeps them out of SAC's count as titanlab does (the fix PyTorch ships
  after 2.13; the ranges compute nothing).
- **The same shape.** A flavor's args can be changed field by field (`MoEShape.changes`,
  `moe_changes`) where torchtitan's flavor of a name differs from titanlab's
  (`tools/ledger_moe_ab.py` names them).
- **DeepSeek-V3's attention.** Its 16B flavor runs FlexAttention with a document mask; here it
  runs SDPA with a causal mask (`attn_type="sdpa"`), as titanlab's step of that shape does,
  with SDPA's memory-efficient kernel enabled beside the cuDNN, flash and math backends
  torchtitan's SDPA wrapper enables: MLA's query and value head dims differ (192, 128), which
  cuDNN's and flash's kernels refuse, so without it the wrapper would run SDPA's unfused math
  fallback, an A/B of that choice instead of the MoE step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tools.lib.torchtitan_ledger import StepBuilder, float8_capable

FAMILIES = {"qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3"}
"""titanlab's family → torchtitan's model of it."""


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A torchtitan MoE flavor, optionally cut to `n_layers` blocks, and the batch."""

    family: str = "qwen3_moe"  # a key of FAMILIES
    flavor: str = "30B-A3B"
    n_layers: int | None = None  # None: the flavor's
    seq_len: int = 4096
    local_batch: int = 1
    changes: tuple[tuple[str, object], ...] = ()  # (field, value) of the model's args
    moe_changes: tuple[tuple[str, object], ...] = ()  # (field, value) of its MoEArgs


def model_args(shape: MoEShape, config):
    """torchtitan's args of `shape` (its flavor's, with the block count), updated from its job
    `config` as its `Trainer` does (`update_from_config`), on the target GPU (an H100: grouped
    GEMMs, which it checks for on the local device)."""
    import importlib

    if shape.family == "qwen3_moe":
        from torchtitan.models.qwen3 import qwen3_args as flavors
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_args as flavors
    changes: dict = {}
    if shape.n_layers is not None:
        changes["n_layers"] = shape.n_layers
    if shape.family == "deepseek_v3":
        changes.update(attn_type="sdpa", attn_mask_type="causal")
    changes.update(shape.changes)
    args = dataclasses.replace(copy.deepcopy(flavors[shape.flavor]), **changes)
    args.moe_args = dataclasses.replace(args.moe_args, **dict(shape.moe_changes))
    module = importlib.import_module(type(args).__module__)
    before = getattr(module, "has_cuda_capability", None)
    module.has_cuda_capability = lambda major, minor: (major, minor) <= (9, 0)  # type: ignore[attr-defined]
    try:
        args.update_from_config(config)
    finally:
        if before is not None:
            module.has_cuda_capability = before  # type: ignore[attr-defined]
    return args


@contextlib.contextmanager
def balanced_splits(ep: int) -> Iterator[None]:
    """torchtitan's dispatch reading a balanced router's all-to-all splits (see the module's
    docstring), with its one host sync a dispatch told to the ledger's recorder. Enter it
    around `parallelize`, which binds each MoE's dispatch (`distribute_module`'s input_fn)."""
    import torchtitan.distributed.expert_parallel as expert_parallel
    from torch._subclasses.fake_tensor import FakeTensor

    from titanlab.config import host_reads
    from titanlab.distributed.expert_parallel import even_splits

    original = expert_parallel.ExpertParallel._token_dispatch

    def dispatch(self, mod: nn.Module, inputs: tuple, device_mesh) -> tuple:
        rows = inputs[0].shape[0]
        splits = even_splits(rows, ep)
        to, tolist = torch.Tensor.to, FakeTensor.tolist
        copies: list[torch.Tensor] = []

        def to_host(t, *args, **kwargs):
            out = to(t, *args, **kwargs)
            copies.append(out)
            return out

        def read(t):
            if not any(t is c for c in copies):
                return tolist(t)
            if count.setdefault("reads", 0) == 1:  # the received splits: the second
                # list, copied with non_blocking=False, the host waits for it
                host_reads.skipped("torchtitan.expert_parallel.splits", t)
            count["reads"] += 1
            return list(splits)

        count: dict[str, int] = {}
        torch.Tensor.to, FakeTensor.tolist = to_host, read  # type: ignore[method-assign]
        try:
            return original(self, mod, inputs, device_mesh)
        finally:
            torch.Tensor.to, FakeTensor.tolist = to, tolist  # type: ignore[method-assign]

    expert_parallel.ExpertParallel._token_dispatch = dispatch
    try:
        yield
    finally:
        expert_parallel.ExpertParallel._token_dispatch = original


@contextlib.contextmanager
def gpu_stand_ins() -> Iterator[None]:
    """torchtitan's `generate_permute_indices` with its triton kernel's output (an index of
    `max_len` rows) written by one fill, and `torch.histc` of the router's integer expert ids
    (CUDA's kernel takes integers, the CPU's does not) as one scatter-add of as many elements
    (see the module's docstring)."""
    import torchtitan.models.moe.utils as moe_utils

    def generate_permute_indices(tokens, experts_per_rank, num_ranks, max_len, alignment,
                                 use_cpu=False):  # fmt: skip
        total = tokens.view(num_ranks, -1).sum(0).clamp_min(alignment)
        m_sizes = ((total + alignment - 1) // alignment * alignment).to(torch.int32)
        m_offsets = torch.cumsum(m_sizes, 0)
        index = torch.full((max_len,), -1, dtype=torch.int32, device=tokens.device)
        return index.long(), m_sizes, m_offsets.to(torch.int32)

    def histc(x, bins=100, min=0, max=0, **kwargs):
        if x.dtype.is_floating_point:
            return histc_(x, bins=bins, min=min, max=max, **kwargs)
        return x.new_zeros(bins).scatter_add_(0, x.long(), torch.ones_like(x))

    original, histc_ = moe_utils.generate_permute_indices, torch.histc
    moe_utils.generate_permute_indices, torch.histc = generate_permute_indices, histc
    try:
        yield
    finally:
        moe_utils.generate_permute_indices, torch.histc = original, histc_


@contextlib.contextmanager
def real_meshes() -> Iterator[None]:
    """FSDP joining a DTensor's expert-parallel mesh to its own (`DeviceMesh._concatenate`,
    inside `fully_shard` of the experts) computes the new mesh's coordinates from real rank
    tensors: done outside the fake tensor mode the step is built in."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)  # type: ignore[method-assign]


def _enable_efficient_attention(model: nn.Module) -> None:
    from torch.nn.attention import SDPBackend
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    for module in model.modules():
        if isinstance(module, ScaledDotProductAttentionWrapper):
            module.sdpa_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # fmt: skip


def _compile_in_place(module: nn.Module, backend: str) -> None:
    from titanlab.distributed.compile import compile_forward

    if type(module).__module__.startswith("torch.nn"):
        compile_forward(module, backend, fullgraph=True)
    else:
        module.compile(backend=backend, fullgraph=True)


@contextlib.contextmanager
def weave_in_place() -> Iterator[None]:
    """torchtitan's `apply_compile` for MoE models, each region compiled in place (see the
    module's docstring)."""
    import torchtitan.models.deepseek_v3.infra.parallelize as deepseek
    import torchtitan.models.qwen3.infra.parallelize as qwen3
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.models.moe import moe as moe_module

    def apply_compile(model: nn.Module, compile_config, ep_enabled: bool) -> None:
        torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan sets it
        backend = compile_config.backend
        for block in model.layers.children():  # type: ignore[union-attr]
            if not block.moe_enabled:
                _compile_in_place(block, backend)
                continue
            inner = (
                block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
            )
            for child in inner.children():
                if isinstance(child, moe_module.MoE):
                    for name, part in child.named_children():
                        if name != "experts":  # torchtitan leaves dispatch and combine eager
                            _compile_in_place(part, backend)
                else:
                    _compile_in_place(child, backend)

    before = qwen3.apply_compile, deepseek.apply_compile
    qwen3.apply_compile = deepseek.apply_compile = apply_compile
    try:
        yield
    finally:
        qwen3.apply_compile, deepseek.apply_compile = before


def step_builder(shape: MoEShape, titan_args: list[str], dp_shard: int, ep: int) -> StepBuilder:
    """A builder for `titanlab.ledger.loop.record_loop`: torchtitan's MoE step of `shape` with
    its options `titan_args` (compile, activation checkpointing), as rank 0 of FSDP over
    `dp_shard` ranks with expert parallel over `ep` of them (the caller makes the default
    process group a fake world of `dp_shard` ranks: `titanlab.distributed.init.init_fake_world`).
    """
    from tools.lib.torchtitan_cpu import use_cpu

    use_cpu()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from titanlab.components.compiled import compile_function

    from titanlab.distributed.activation_checkpoint import _ignore_profiler_ops_in_sac

    _ignore_profiler_ops_in_sac()  # torchtitan#3427 on torch 2.13 (see the module's docstring)
    spec = get_train_spec(FAMILIES[shape.family])
    config = ConfigManager().parse_args([
        "--model.name", FAMILIES[shape.family], "--model.flavor", shape.flavor,
        "--training.seq_len", str(shape.seq_len),
        "--training.local_batch_size", str(shape.local_batch),
        "--training.max_norm", "1.0",
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.expert_parallel_degree", str(ep), *titan_args,
    ])  # fmt: skip
    args = model_args(shape, config)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=1, pp=1, ep=ep, etp=1,
                        world_size=dp_shard)  # fmt: skip
    dims.build_mesh()

    def build() -> Callable[[], None]:
        with torch.device("cpu"):
            model = spec.model_cls(args)
        if shape.family == "deepseek_v3":
            _enable_efficient_attention(model)
        with float8_capable():
            build_model_converters(config, dims).convert(model)
        with weave_in_place(), balanced_splits(ep), real_meshes():
            model = spec.parallelize_fn(model, dims, config)
        loss_fn = cross_entropy_loss
        if config.compile.enable and "loss" in config.compile.components:
            loss_fn = compile_function(cross_entropy_loss)
        optimizers = spec.build_optimizers_fn([model], config.optimizer, dims)
        params = list(model.parameters())
        tokens = torch.zeros(shape.local_batch, shape.seq_len, dtype=torch.long)
        amp = dist_utils.maybe_enable_amp(dims, config.training.mixed_precision_param, "cpu")

        def step() -> None:
            optimizers.zero_grad()
            with gpu_stand_ins(), amp:
                pred = model(tokens)
                loss = loss_fn(pred, tokens) / tokens.numel()
                del pred
                loss.backward()
            dist_utils.clip_grad_norm_(params, config.training.max_norm, foreach=True,
                                       ep_enabled=dims.ep_enabled)  # fmt: skip
            optimizers.step()

        return step

    def group_dims() -> dict[str, str]:
        named = {"fsdp": "dp_shard", "ep": "ep", "efsdp": "efsdp"}
        out = {}
        for mesh_name, dim in named.items():
            mesh = dims.get_optional_mesh(mesh_name)
            if mesh is not None:
                out[mesh.get_group().group_name] = dim
        return out

    return StepBuilder(build, group_dims)
