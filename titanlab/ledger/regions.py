"""The compiled regions a recorded step runs (`Regions`): modules compiled with
`nn.Module.compile` or wrapped by `torch.compile`, and each call of a function compiled with
`titanlab.components.compiled.compile_function`, whose ops `titanlab.ledger.price` prices as
Inductor's fused kernels. Used by `titanlab.ledger.record.Recorder`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from titanlab.distributed.compile import forward_compiled


def _compiled(module: torch.nn.Module) -> bool:
    """Whether `module` runs compiled: `nn.Module.compile` (titanlab's blocks), its forward
    compiled by `titanlab.distributed.compile.compile_forward` (the norms of an MoE block), or
    wrapped by `torch.compile(module)` (an `OptimizedModule`, as torchtitan compiles its
    blocks)."""
    return (
        getattr(module, "_compiled_call_impl", None) is not None
        or forward_compiled(module)
        or isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
    )


@dataclass
class Regions:
    """The compiled modules and functions running now (forward or backward), innermost last,
    and the autograd nodes of compiled functions' backward, by region."""

    stack: list[int | None] = field(default_factory=list)
    ids: dict[Any, int] = field(default_factory=dict)
    nodes: dict[Any, int] = field(default_factory=dict)
    fused_modules: bool = True
    """Whether compiled modules are Inductor's fused code (`compile.backend` "inductor"); with
    another backend (aot_eager, eager) their ops are eager kernels: no region."""

    def enter_module(self, module: torch.nn.Module) -> None:
        if _compiled(module):
            region = self.ids.setdefault(id(module), len(self.ids))
            self.stack.append(region if self.fused_modules else None)

    def leave_module(self, module: torch.nn.Module) -> None:
        if _compiled(module) and self.stack:
            self.stack.pop()

    # a `titanlab.components.compiled.compile_function` call: a region of its own
    def enter(self, name: str, args: tuple, kwargs: dict) -> tuple[int, set]:
        region = self.ids.setdefault((name, len(self.ids)), len(self.ids))
        self.stack.append(region)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return region, {t.grad_fn for t in tensors if t.grad_fn is not None}

    def leave(self, token: tuple[int, set], outputs: Any) -> None:
        """Close the call's region; the autograd nodes it made (its backward) join it: those
        reachable from its outputs before its inputs' own nodes or a leaf's accumulation."""
        region, boundary = token
        self.stack.pop()
        floor = max((n._sequence_nr() for n in boundary), default=-1)
        todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        while todo:
            node = todo.pop()
            if node is None or node in boundary or node in self.nodes:
                continue
            if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() <= floor:
                continue
            self.nodes[node] = region
            todo.extend(n for n, _ in node.next_functions)

    def current(self) -> int | None:
        """The innermost region running: a compiled module's, a compiled function's, or the
        one whose backward node autograd runs now."""
        if self.stack:
            return self.stack[-1]
        return self.nodes.get(torch._C._current_autograd_node())
