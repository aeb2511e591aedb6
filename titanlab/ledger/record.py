"""Recording one training step op by op: every aten op a rank runs, with its module path, phase,
FLOPs, bytes and dtypes, and every collective with its kind, bytes and group.

`Recorder` is a `TorchDispatchMode` entered inside a `FakeTensorMode` (the dry run's fake
step), so the ops run on tensors without memory and the shapes are those of the real run:

- **Rank-local ops.** An op on DTensors (or on any wrapper subclass: torchao's float8 and NF4
  tensors) is left to the subclass (the mode returns NotImplemented, as `FakeTensorMode` does
  for subclasses it does not know), which runs its inner ops: the rank's local ops on its
  shards, float8's `_scaled_mm`, NF4's dequantization; those are what is recorded. DTensor's
  sharding propagation computes output shapes by running the op on global-shape fake
  tensors: ops run from `_propagate_tensor_meta_non_cached` are not the rank's work and are
  not recorded.
- **Phases**: forward, backward (whatever autograd's engine runs, recomputation included),
  grad_norm and optimizer (the ops inside the profiler ranges `_PHASES` names); what runs
  outside them and outside every module (the token count, a loss outside the model) is
  "step".
- **Module paths** come from `torch.distributed._tools.mod_tracker.ModTracker` (forward and
  backward), without wrapper names (`_checkpoint_wrapped_module`, `_orig_mod`). A module
  compiled with `nn.Module.compile` (the blocks, `titanlab.distributed.parallelize`) makes the
  ops of its forward and backward one *compiled region*: `titanlab.ledger.price` prices the
  pointwise ops inside one as fused.
- **FLOPs** from torch's `torch.utils.flop_counter.flop_registry` (matmuls, SDPA and its
  backward, flash and efficient attention), plus `FLOPS`' own: the CPU flash-attention
  kernels the fake step runs in place of the GPU's, and grouped GEMM.
- **Bytes**: every tensor argument an op reads and every tensor it returns, at the fake tensors'
  sizes; views read and write nothing.
- **Collectives**: the functional collectives (`_c10d_functional.*`) DTensor and FSDP2 issue,
  with the bytes of the buffer they move (the gathered size of an all-gather, the input of a
  reduce-scatter) and the size and name of their process group.

Source: the PyTorch docs of `torch.utils._python_dispatch.TorchDispatchMode`, `FakeTensorMode`
and `torch.utils.flop_counter`; torch's `torch/distributed/_tools/runtime_estimator.py` prices
ops under a fake mode the same way but skips DTensor and communication.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod", "._fsdp_wrapped_module")
_SHAPE_PROPAGATION = "_propagate_tensor_meta_non_cached"
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
         "lift_fresh", "device", "_unsafe_view", "alias", "set_"}  # fmt: skip
_WRITE_ONLY = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros",
               "new_ones", "new_full", "scalar_tensor", "fill_", "zero_", "arange"}  # fmt: skip
"""Ops that write their output and read no tensor's values (a memset, a fill)."""
_COLLECTIVES = {
    # functional collectives (DTensor, torchtitan-style code) and c10d's in-place ones (FSDP2)
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_ATTENTION = ("attention", "flash", "sdpa")
_RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
_RANGE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
_PHASES = (("titanlab::clip_grad_norm", "grad_norm"), ("Optimizer.step", "optimizer"))
"""Profiler ranges (`torch.profiler.record_function`) whose ops form a phase: the gradient norm
and clipping (`titanlab.distributed.utils.clip_grad_norm_`), `torch.optim`'s step."""


@dataclass
class OpRecord:
    """One op a rank ran in the step.

    `flops` in floating-point operations (a multiply-add is 2); `bytes_read` / `bytes_written`
    in bytes; `dtype` the compute dtype (a GEMM's inputs', else the output's); `kind` one of
    gemm, attention, collective, pointwise, view, other; `region` the compiled region's id
    (None outside compiled code); `inputs` / `outputs` the ids of the tensors read and made
    (`Recorder` numbers each fake tensor once)."""

    op: str
    module: str
    phase: str
    kind: str
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    region: int | None = None
    collective: str = ""
    group_size: int = 1
    group: str = ""
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """`torch._grouped_mm(a (tokens, k), b (groups, k, n), offs)`: each token row meets one
    group's (k, n) matrix, 2·tokens·k·n FLOPs (2D × 3D, the MoE experts' form)."""
    return 2 * a.shape[0] * a.shape[-1] * b.shape[-1] if b.dim() == 3 else 0


def _flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas, plus those it has none for: the CPU flash-attention kernels the
    fake step runs (the same arguments as the CUDA ones, so their formulas) and grouped GEMM."""
    aten = torch.ops.aten
    table = dict(flop_registry)
    table[aten.addmm_] = flop_registry[aten.addmm]  # in place, the same arguments
    table[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention
    ]
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ]
    if hasattr(aten, "_grouped_mm"):
        table[aten._grouped_mm] = _grouped_mm_flops
    return table


FLOPS = _flop_formulas()


def _kind(func: Any, name: str) -> str:
    namespace, op = name.split(".")[:2]
    if func.overloadpacket in FLOPS:
        return "attention" if any(a in name for a in _ATTENTION) else "gemm"
    if namespace in ("_c10d_functional", "c10d") and op in _COLLECTIVES:
        return "collective"
    if op == "_local_scalar_dense":
        return "sync"  # `.item()`: the host waits for the device
    if func.is_view or op in _FREE or namespace == "profiler":
        return "view"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    return "other"


def _mutated_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes of the tensors an op writes in place and does not return (a fused or foreach
    optimizer's parameters and moments): the arguments its schema marks as written."""
    total = 0
    for i, arg in enumerate(func._schema.arguments):
        # the fused optimizers mark their gradients writable (for an unscale) but only read them
        if arg.alias_info is None or not arg.alias_info.is_write or arg.name == "grads":
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        total += sum(_nbytes(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return total


def _in_shape_propagation() -> bool:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code.co_name == _SHAPE_PROPAGATION:
            return True
        frame = frame.f_back
    return False


def _clean(fqn: str) -> str:
    for wrapper in _WRAPPERS:
        fqn = fqn.replace(wrapper, "")
    return fqn.split(".", 1)[1] if "." in fqn else ""


@dataclass
class _Regions:
    """The compiled modules running now (forward or backward), innermost last."""

    stack: list[int] = field(default_factory=list)
    ids: dict[int, int] = field(default_factory=dict)

    def enter(self, module: torch.nn.Module) -> None:
        if getattr(module, "_compiled_call_impl", None) is not None:
            self.stack.append(self.ids.setdefault(id(module), len(self.ids)))

    def leave(self, module: torch.nn.Module) -> None:
        if getattr(module, "_compiled_call_impl", None) is not None and self.stack:
            self.stack.pop()


class Recorder(TorchDispatchMode):
    """Records the ops of the code run inside it (`ops`, in order). Enter it inside a
    `FakeTensorMode`; `phase(name)` labels what follows (forward and backward are told apart by
    autograd: an op run by the backward engine is "backward" whatever the label)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self._phase = "step"
        self._serial: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self._regions = _Regions()
        self._ranges: dict[int, str] = {}  # open profiler ranges (record_function), by handle
        self._modules = ModTracker()
        self._modules.register_user_hooks(
            pre_fw_hook=lambda m, i: self._regions.enter(m),
            post_fw_hook=lambda m, i, o: self._regions.leave(m),
            pre_bw_hook=lambda m, g: self._regions.enter(m),
            post_bw_hook=lambda m, g: self._regions.leave(m),
        )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the ops run inside as `name` (e.g. "optimizer")."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def __enter__(self):
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._modules.__exit__(*exc)

    def _id(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self._serial:
            self._serial[key] = len(self._serial)
            self._alive.append(t)
        return self._serial[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(is_traceable_wrapper_subclass(a) for a in leaves):
            # DTensor, torchao's float8 and NF4 tensors run their inner ops (the rank's local
            # ones, `_scaled_mm`, the dequantization), which are recorded as they come
            return NotImplemented
        out = func(*args, **kwargs)
        if func is _RANGE_ENTER:
            self._ranges[id(out)] = args[0]
            return out
        if func is _RANGE_EXIT:
            self._ranges.pop(id(args[0]), None)
            return out
        if _in_shape_propagation():
            return out
        self.ops.append(self._record(func, args, kwargs, leaves, out))
        return out

    def _record(self, func, args, kwargs, leaves, out) -> OpRecord:
        name = str(func)
        ins = [a for a in leaves if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        kind = _kind(func, name)
        running = self._modules.parents - {"Global"}  # the innermost: the most dotted name
        in_module = bool(running)
        phase = "backward" if self._modules.is_bw else "forward" if in_module else self._phase
        for label in self._ranges.values():  # the innermost named range that is a phase
            phase = next((p for prefix, p in _PHASES if label.startswith(prefix)), phase)
        module = _clean(max(running, key=lambda n: (n.count("."), n))) if running else ""
        rec = OpRecord(name, module, phase, kind, shape=tuple(outs[0].shape) if outs else ())
        rec.region = self._regions.stack[-1] if self._regions.stack else None
        rec.inputs = tuple(self._id(t) for t in ins)
        rec.outputs = tuple(self._id(t) for t in outs)
        dtype_of = ins if kind in ("gemm", "attention") and ins else outs or ins
        rec.dtype = str(dtype_of[0].dtype).removeprefix("torch.") if dtype_of else ""
        if kind == "view":
            return rec
        rec.bytes_read = 0 if name.split(".")[1] in _WRITE_ONLY else sum(_nbytes(t) for t in ins)
        rec.bytes_written = sum(_nbytes(t) for t in outs) or _mutated_bytes(func, args, kwargs)
        if kind in ("gemm", "attention"):
            rec.flops = int(FLOPS[func.overloadpacket](*args, **kwargs, out_val=out))
        if kind == "collective":
            _collective(rec, _COLLECTIVES[name.split(".")[1]], leaves)
        return rec


def _collective(rec: OpRecord, kind: str, leaves: list) -> None:
    """Fill in a collective's kind, group and the bytes of the buffer it moves: the gathered
    size of an all-gather, the input of a reduce-scatter or all-to-all (the largest tensor
    argument either way), the tensors of an all-reduce."""
    rec.collective = kind
    boxed = next((a for a in leaves if isinstance(a, torch.ScriptObject)), None)
    group: Any = dist.ProcessGroup.unbox(boxed) if boxed is not None else None  # c10d's ops
    if group is None:  # a functional collective names its group
        names = [a for a in leaves if isinstance(a, str)]  # its last string argument
        with contextlib.suppress(Exception):
            group = dist.distributed_c10d._resolve_process_group(names[-1])  # type: ignore[arg-type]
    if group is not None:
        rec.group, rec.group_size = group.group_name, group.size()
    sizes = [_nbytes(t) for t in leaves if isinstance(t, torch.Tensor)]
    moved = sum(sizes) if kind == "all_reduce" else max(sizes, default=0)
    rec.bytes_read = rec.bytes_written = moved
