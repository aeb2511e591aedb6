"""Count the communication one rank issues: calls and bytes per collective kind.

`CommCounter` is a `TorchDispatchMode` that sees every process-group operation on its way to the
backend, whoever calls it:
- FSDP2, DDP, `torch.distributed.*` and pipelining call the `c10d` ops (`_allgather_base_`,
  `_reduce_scatter_base_`, `allreduce_`, `send`, `recv_`, ...); point-to-point messages of
  `batch_isend_irecv` reach the dispatcher as `c10d.send` / `c10d.recv_` too;
- DTensor (tensor parallel, loss parallel, `full_tensor`) calls the functional collectives
  (`_c10d_functional.all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`, ...), which
  are counted once: the `c10d` op they run inside is hidden from the mode that handles them.
`torch.distributed.tensor.debug.CommDebugMode` sees the same ops in torch 2.13 but records only
call counts, and not send/recv, hence this counter.

What "bytes" means (one definition for every formula in docs/parallelism.md): the size of the
full logical tensor the operation is about, on this rank, whatever the algorithm:
- all_gather: the gathered output (group size × this rank's input);
- reduce_scatter: the unreduced input (group size × this rank's output);
- all_reduce, broadcast: the tensor; all_to_all: this rank's input;
- send / recv: the message this rank sends / receives;
- gather, scatter, reduce (unused by titanlab): the tensors of the op's first argument.
`wire_bytes` is what this rank itself sends under a bandwidth-optimal ring with group size n
(Patarasuk & Yuan 2009; the NCCL performance notes): all_gather and reduce_scatter
bytes·(n−1)/n, all_reduce 2·bytes·(n−1)/n, all_to_all the input minus the split it keeps
(bytes·(n−1)/n with equal splits; all of it for the `permute_tensor` of context parallel's
ring, which sends the whole buffer to the next rank), send bytes, recv 0, broadcast
bytes·(n−1)/n (a chain, averaged over its ranks).

Set `TITANLAB_COMM_COUNT=<path>` and the trainer counts step 2 (`count_step_comms`) and writes
`<path>.rank<r>.json` on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # a NewType of str

ENV_VAR = "TITANLAB_COMM_COUNT"
COUNTED_STEP = 2  # step 1 also holds one-off traffic (pipeline shape exchange, lazy init)

# op name (overload packet, any of the three collective namespaces) → kind
_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
    "barrier": "barrier",
}
_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
# Ring factor on `bytes` giving `wire_bytes`, as a function of the group size n.
_WIRE = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested list of) argument(s)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _group_size(group: Any) -> int | None:
    """Size of a process group given as a c10d ScriptObject, a ProcessGroup or a group name."""
    try:
        if isinstance(group, torch.ScriptObject):
            return dist.ProcessGroup.unbox(group).size()
        if isinstance(group, dist.ProcessGroup):
            return group.size()
        if isinstance(group, str):
            return _resolve_process_group(cast("GroupName", group)).size()
    except (RuntimeError, TypeError, ValueError, KeyError):
        pass
    return None


def _all_to_all_kept(ns: str, args: tuple) -> float | None:
    """The fraction of an all_to_all's input this rank sends to itself, from its input split
    sizes; None when the splits are not given (equal splits)."""
    # functional: (input, output_split_sizes, input_split_sizes, group_name);
    # c10d alltoall_base_: (output, input, output_split_sizes, input_split_sizes, group, ...).
    splits, group = (args[2], args[3]) if ns != "c10d" else (args[3], args[4])
    if not isinstance(splits, (list, tuple)) or not splits or not sum(splits):
        return None
    try:
        if isinstance(group, torch.ScriptObject):
            rank = dist.ProcessGroup.unbox(group).rank()
        else:
            rank = _resolve_process_group(cast("GroupName", group)).rank()
    except (RuntimeError, TypeError, ValueError, KeyError):
        return None
    return splits[rank] / sum(splits)


def _measure(ns: str, kind: str, args: tuple) -> tuple[int, int]:
    """(bytes, group size) of one call, with `bytes` as defined in the module docstring."""
    # c10d ops take (outputs, inputs, group, ...) or (tensors, group, ...); functional
    # collectives (input(s), ..., group_name[, out]). The group is the last resolvable argument.
    n = next((g for g in map(_group_size, reversed(args)) if g is not None), 1)
    if ns == "c10d":
        if kind in ("reduce_scatter", "all_to_all"):
            return _nbytes(args[1]), n
        return _nbytes(args[0]), n  # all_gather: the outputs; others: the tensors
    size = _nbytes(args[0])
    return (size * n if kind == "all_gather" else size), n


class CommCounter(TorchDispatchMode):
    """Context manager counting this rank's collectives and point-to-point messages.

    Usage: `with CommCounter() as c: step(); c.summary()`. It lets tensor subclasses (DTensor)
    run before it, as `CommDebugMode` does, so collectives DTensor issues inside an op (sharding
    propagation's redistributions) are counted too. Counts only ops issued on the thread
    that entered it (CPU autograd runs backward on that thread, so FSDP's and DTensor's backward
    communication is included). Adds a Python call per dispatched op: for measurement only.
    """

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[str, int] = defaultdict(int)
        self._bytes: dict[str, int] = defaultdict(int)
        self._wire: dict[str, float] = defaultdict(float)
        self._sizes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Modes run before tensor subclasses. Declining here lets DTensor run first; the plain
        # ops and collectives it issues (its redistributions) then come back to this mode.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        ns = func.namespace
        if ns in _NAMESPACES:
            kind = _KINDS.get(func._overloadpacket.__name__)
            if kind is not None:
                allargs = tuple(args) + tuple(kwargs.values())
                nbytes, n = _measure(ns, kind, allargs)
                self._calls[kind] += 1
                self._bytes[kind] += nbytes
                kept = _all_to_all_kept(ns, allargs) if kind == "all_to_all" else None
                sent = 1 - kept if kept is not None else _WIRE.get(kind, lambda n: 0.0)(n)
                self._wire[kind] += nbytes * sent
                self._sizes[kind][f"{nbytes}x{n}"] += 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, Any]]:
        """{kind: {"calls": int, "bytes": int, "wire_bytes": int, "sizes": {"<bytes>x<group
        size>": calls}}} for every kind seen; bytes as defined in the module docstring."""
        return {
            k: {
                "calls": self._calls[k],
                "bytes": self._bytes[k],
                "wire_bytes": round(self._wire[k]),
                "sizes": dict(sorted(self._sizes[k].items())),
            }
            for k in sorted(self._calls)
        }

    def write_json(self, path: str, **extra: Any) -> None:
        """Write `{**extra, "kinds": summary()}` to `path` atomically."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**extra, "kinds": self.summary()}, f, indent=1)
        os.replace(tmp, path)


@contextlib.contextmanager
def _count_to_file(path: str, step: int):
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    with CommCounter() as counter:
        yield counter
    counter.write_json(f"{path}.rank{rank}.json", rank=rank, world_size=world, step=step)


def count_step_comms(step: int) -> contextlib.AbstractContextManager:
    """The trainer's hook: a `CommCounter` writing `$TITANLAB_COMM_COUNT.rank<r>.json` when that
    variable is set and `step` is `COUNTED_STEP`, else a no-op context."""
    path = os.environ.get(ENV_VAR)
    if not path or step != COUNTED_STEP:
        return contextlib.nullcontext()
    return _count_to_file(path, step)
