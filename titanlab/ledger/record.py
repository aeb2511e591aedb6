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
  compiled with `nn.Module.compile` (the blocks, `titanlab.distributed.parallelize`) or wrapped
  by `torch.compile(module)` makes the
  ops of its forward and backward one *compiled region*, and so does each call of a function
  compiled with `titanlab.components.compiled.compile_function` (the loss, the fused loss's
  chunks): its forward ops, and in backward the autograd nodes the call made (reached from its
  outputs, up to its inputs' nodes). `titanlab.ledger.price` prices the pointwise ops inside a
  region as fused.
- **FLOPs** from torch's `torch.utils.flop_counter.flop_registry` (matmuls, SDPA and its
  backward, flash and efficient attention), plus `FLOPS`' own: the CPU flash-attention
  kernels the fake step runs in place of the GPU's, and grouped GEMM. Causal attention counts
  the tiles a flash kernel computes (`causal_fraction`), not the whole square.
- **Bytes**: every tensor argument an op reads and every tensor it returns, at the fake tensors'
  sizes; views read and write nothing.
- **Collectives**: the functional collectives (`_c10d_functional.*`) DTensor and FSDP2 issue,
  with the bytes of the buffer they move (the gathered size of an all-gather, the input of a
  reduce-scatter) and the size and name of their process group; and their `wait_tensor`s, a
  wait eager GPU code defers to the result's first use marked `deferred`.
- **Host syncs** (kind "sync"): what `host_read` is told: a device tensor's value read on the
  host (`.item()`, `.tolist()`, `bool()`: `titanlab.ledger.step.HostReads`), a device-to-host
  copy (`.cpu()`: `titanlab.ledger.step.DeviceToHost`), and a read the code itself skipped on
  fake tensors (`titanlab.config.host_reads.skipped`: expert parallel's split sizes), each
  with the bytes copied to the host.

Source: the PyTorch docs of `torch.utils._python_dispatch.TorchDispatchMode`, `FakeTensorMode`
and `torch.utils.flop_counter`; torch's `torch/distributed/_tools/runtime_estimator.py` prices
ops under a fake mode the same way but skips DTensor and communication.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from titanlab.components import compiled
from titanlab.config import host_reads
from titanlab.ledger.flops import FLOPS, argument, causal_fraction
from titanlab.ledger.regions import Regions

_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod", "._fsdp_wrapped_module")
_SHAPE_PROPAGATION = "_propagate_tensor_meta_non_cached"
_ASYNC_WRAPPER = "_maybe_wrap_tensor"  # torch.distributed._functional_collectives
# is_pinned: a host-side query (torchao's float8 FSDP hooks ask it), no kernel
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
         "lift_fresh", "device", "_unsafe_view", "alias", "set_", "wait_tensor",
         "is_pinned"}  # fmt: skip
_WRITE_ONLY = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros",
               "new_ones", "new_full", "scalar_tensor", "fill_", "zero_", "arange"}  # fmt: skip
"""Ops that write their output and read no tensor's values (a memset, a fill)."""
_SPARSE_WRITES = {"scatter_", "scatter_add_", "scatter_reduce_", "index_put_", "index_add_",
                  "index_copy_", "index_fill_"}  # fmt: skip
"""In-place ops that touch only the rows their index names: they read the index and source and
read-modify-write as many elements of their first argument, not all of it."""
_SPARSE_READS = {"gather", "embedding", "index_select", "nll_loss_forward", "nll_loss2d_forward"}
"""Ops that read only the elements their index names (a gathered row, a label's logit): as many
bytes as they write, plus the index."""
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
    rowwise: bool = False
    """A float8 GEMM (`_scaled_mm`, `_scaled_grouped_mm`) scaled per row, not per tensor."""
    tiles: float | None = None
    """FlexAttention (its stand-in, `titanlab::flex_attention`): the share of its (128 × 128)
    tiles the block mask computes."""
    deferred: bool = False
    """A `wait_tensor` that eager code on a GPU makes at the first op reading the collective's
    result, not here: torch's functional collectives return an `AsyncCollectiveTensor` there,
    but wait at once under `FakeTensorMode` (`_maybe_wrap_tensor`, which assumes a trace). The
    waits of C++ code (the autograd all-to-all's backward) are where they are."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _called_from(name: str, depth: int) -> bool:
    """Whether a function named `name` is among the `depth` callers of the op running now."""
    frame: FrameType | None = sys._getframe(3)  # above this, the check's caller and _record
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def _clean(fqn: str) -> str:
    for wrapper in _WRAPPERS:
        fqn = fqn.replace(wrapper, "")
    return fqn.split(".", 1)[1] if "." in fqn else ""


class Recorder(TorchDispatchMode):
    """Records the ops of the code run inside it (`ops`, in order). Enter it inside a
    `FakeTensorMode`; `phase(name)` labels what follows (forward and backward are told apart by
    autograd: an op run by the backward engine is "backward" whatever the label).
    `compile_backend`: the backend compiled modules use (`compile.backend`); only Inductor's
    make fused regions. Compiled functions (`compile_function`) are Inductor's always."""

    def __init__(self, compile_backend: str = "inductor") -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self._phase = "step"
        self._serial: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self._regions = Regions(fused_modules=compile_backend == "inductor")
        # Open profiler ranges (record_function), innermost last. A stack, not a map by handle:
        # the exit op's handle reaches this mode as another Python object than the enter op
        # returned, so a map by id() never closed a range, and a phase could stick to the ops
        # after it (the optimizer's labelled as a closed range's, when an id was reused).
        self._ranges: list[str] = []
        self._modules = ModTracker()
        self._modules.register_user_hooks(
            pre_fw_hook=lambda m, i: self._regions.enter_module(m),
            post_fw_hook=lambda m, i, o: self._regions.leave_module(m),
            pre_bw_hook=lambda m, g: self._regions.enter_module(m),
            post_bw_hook=lambda m, g: self._regions.leave_module(m),
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
        compiled.OBSERVERS.append(self._regions)
        host_reads.OBSERVERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        host_reads.OBSERVERS.remove(self)
        compiled.OBSERVERS.remove(self._regions)
        self._modules.__exit__(*exc)

    def host_read(self, what: str, tensor: torch.Tensor) -> None:
        """Record a host sync: `tensor` (a device tensor on the GPU) read or copied to the
        host, `what` naming how (an op name, `Tensor.cpu`, a skipped read's name)."""
        rec = self._place(OpRecord(what, "", "", "sync", dtype=str(tensor.dtype).removeprefix(
            "torch."), shape=tuple(tensor.shape)))  # fmt: skip
        rec.bytes_read = rec.bytes_written = _nbytes(tensor)
        rec.inputs = (self._id(tensor),)
        self.ops.append(rec)

    def _place(self, rec: OpRecord) -> OpRecord:
        """`rec` with the module, phase and compiled region of the code running now."""
        running = self._modules.parents - {"Global"}  # the innermost: the most dotted name
        phase = "backward" if self._modules.is_bw else "forward" if running else self._phase
        for label in self._ranges:  # the innermost named range that is a phase
            phase = next((p for prefix, p in _PHASES if label.startswith(prefix)), phase)
        rec.module = _clean(max(running, key=lambda n: (n.count("."), n))) if running else ""
        rec.phase = phase
        rec.region = self._regions.current()
        return rec

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
            self._ranges.append(args[0])
            return out
        if func is _RANGE_EXIT:  # record_function's ranges nest: the innermost closes
            if self._ranges:
                self._ranges.pop()
            return out
        if _called_from(_SHAPE_PROPAGATION, 16):
            return out
        self.ops.append(self._record(func, args, kwargs, leaves, out))
        return out

    def _record(self, func, args, kwargs, leaves, out) -> OpRecord:
        name = str(func)
        out_args = {id(t) for t in tree_leaves(kwargs.get("out"))}  # written, not read
        ins = [a for a in leaves if isinstance(a, torch.Tensor) and id(a) not in out_args]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        kind = _kind(func, name)
        rec = self._place(OpRecord(name, "", "", kind, shape=tuple(outs[0].shape) if outs else ()))
        rec.inputs = tuple(self._id(t) for t in ins)
        rec.outputs = tuple(self._id(t) for t in outs)
        dtype_of = ins if kind in ("gemm", "attention") and ins else outs or ins
        rec.dtype = str(dtype_of[0].dtype).removeprefix("torch.") if dtype_of else ""
        if kind == "view":
            # functional collectives' `_maybe_wrap_tensor`, 16 frames up: the modes and
            # wait_tensor's autograd between
            rec.deferred = name.startswith("_c10d_functional.wait_tensor") and (
                _called_from(_ASYNC_WRAPPER, 32)
            )
            return rec
        rec.bytes_read = 0 if name.split(".")[1] in _WRITE_ONLY else sum(_nbytes(t) for t in ins)
        rec.bytes_written = sum(_nbytes(t) for t in outs) or _mutated_bytes(func, args, kwargs)
        if name.split(".")[1] in _SPARSE_READS:
            index = sum(_nbytes(t) for t in ins if not t.is_floating_point())
            rec.bytes_read = rec.bytes_written + index
        if name.split(".")[1] in _SPARSE_WRITES and ins:
            touched = sum(_nbytes(t) for t in ins[1:] if t.is_floating_point())
            rec.bytes_read = sum(_nbytes(t) for t in ins[1:]) + touched
            rec.bytes_written = touched
        if kind in ("gemm", "attention"):
            rec.flops = int(FLOPS[func.overloadpacket](*args, **kwargs, out_val=out))
        if name.startswith(("aten._scaled_mm", "aten._scaled_grouped_mm")):
            rec.rowwise = args[2].numel() > 1  # scale_a: one per tensor, or one per row
        if name == "titanlab.flex_attention.default":
            rec.tiles = float(args[3])
        if kind == "attention" and argument(func, args, kwargs, "is_causal"):
            rec.flops = int(rec.flops * causal_fraction(ins[0].shape[-2]))
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


def fsdp_copy(op: str, phase: str) -> bool:
    """Whether the op is FSDP2's copy through its flat buffers (`fsdp.*` custom ops, and the
    foreach copy-out into the unsharded parameters), which it runs per collective call, in its
    hooks: eager code, also inside a compiled block (the hooks are `torch._dynamo.disable`d)."""
    return op.startswith("fsdp.") or (
        op == "aten._foreach_copy_.default" and phase in ("forward", "backward")
    )
