"""Context parallel on CPU: the two pieces torch 2.13's `context_parallel` lacks for the CPU
SDPA kernel, supplied through torch's own ring attention.

torch's context parallel turns q, k, v into DTensors sharded on the sequence dim and sends the
SDPA op to ring-attention handlers, but its handler table and its sharding rules list only the
CUDA kernels (flash, memory-efficient, cuDNN). The ring algorithm itself
(`_templated_ring_attention` and its backward, in
`torch/distributed/tensor/experimental/_context_parallel/_attention.py`) is device-agnostic, and
the CPU flash kernel `aten._scaled_dot_product_flash_attention_for_cpu` returns the output and a
float32 log-sum-exp (B, H, S), all the ring's merge needs; its backward takes them back
(measured: see `../shared/notes/torch_2.13_cpu_distributed_facts.md`). `install()` adds, for that
kernel and its backward:
- DTensor sharding strategies: everything replicated, sharded on heads (dim 1), or sharded on
  the sequence (dim 2, context parallel);
- a custom-op handler, put into torch's CP handler table so that it is active exactly while
  `context_parallel` is, which runs torch's ring with the CPU kernel.

Private torch names used are listed in `PRIVATE_NAMES`; `check_private_names()` imports each and
raises one line naming the first missing one (the validator refuses CP on CPU with it, and a test
guards a torch upgrade).
"""

from __future__ import annotations

import importlib

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

aten = torch.ops.aten
SEQ_DIM = 2
_CP_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"
PRIVATE_NAMES = (
    (_CP_ATTENTION, "_templated_ring_attention"),
    (_CP_ATTENTION, "_templated_ring_attention_backward"),
    (_CP_ATTENTION, "custom_ops"),
    ("torch.distributed.tensor._ops.utils", "register_op_strategy"),
    ("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy"),
    ("torch.distributed.tensor._op_schema", "RuntimeSchemaInfo"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward"),
)


class PrivateNameMissing(RuntimeError):
    """A torch internal that CP on CPU relies on is gone (a torch upgrade moved it)."""


def check_private_names() -> None:
    """Raise PrivateNameMissing (one line) for the first of `PRIVATE_NAMES` this torch lacks."""
    for module_name, attr in PRIVATE_NAMES:
        try:
            module = (
                torch.ops.aten
                if module_name == "torch.ops.aten"
                else importlib.import_module(module_name)
            )
            getattr(module, attr)
        except (ImportError, AttributeError, RuntimeError):
            raise PrivateNameMissing(
                f"torch {torch.__version__} has no {module_name}.{attr}, which context parallel "
                "on CPU uses"
            ) from None


_installed = False


def install() -> None:
    """Register the CPU kernel's strategies and CP handler (idempotent). Raises
    PrivateNameMissing when this torch lacks a name it needs."""
    global _installed
    if _installed:
        return
    check_private_names()
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy

    cp_attention = importlib.import_module(_CP_ATTENTION)
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    register_op_strategy(fwd, schema_info=RuntimeSchemaInfo(3))(_forward_strategy)
    register_op_strategy(bwd, schema_info=RuntimeSchemaInfo(6))(_backward_strategy)
    cp_attention.custom_ops[fwd] = _ring_handler
    cp_attention.custom_ops[bwd] = _ring_handler
    _installed = True


def _strategies(n: int) -> list[list]:
    """Placements of `n` outputs + inputs: all replicated, all on heads, all on the sequence."""
    return [[Replicate()] * n, [Shard(1)] * n, [Shard(SEQ_DIM)] * n]


def _forward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (output, logsumexp) from (query, key, value)
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _strategies(5), input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    # (grad q, k, v) from (grad_out, query, key, value, out, logsumexp)
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _strategies(9), input_index=3)


def _ring_handler(op_call, args: tuple, kwargs: dict) -> object:
    """DTensor custom-op handler: run torch's ring attention with the CPU kernel on the local
    sequence shards and wrap the results back as DTensors sharded on the sequence."""
    cp_attention = importlib.import_module(_CP_ATTENTION)
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError("context parallel: q, k, v must all be sharded on the sequence dim")
    group = op_info.compute_mesh.get_group()
    local = dict(zip(_arg_names(op_call), op_info.local_args))
    local.update(op_info.local_kwargs)
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, value = local.pop("query"), local.pop("key"), local.pop("value")
        is_causal = bool(local.pop("is_causal", False))
        results = cp_attention._templated_ring_attention(
            group, SEQ_DIM, op_call, query, key, value, is_causal=is_causal, **local
        )
    else:
        results = cp_attention._templated_ring_attention_backward(
            group,
            SEQ_DIM,
            op_call,
            grad_out=local.pop("grad_out"),
            grad_out_name="grad_out",
            query=local.pop("query"),
            key=local.pop("key"),
            value=local.pop("value"),
            out=local.pop("out"),
            logsumexp=local.pop("logsumexp"),
            is_causal=bool(local.pop("is_causal")),
            **local,
        )
    return dispatcher.wrap(tuple(results), sharding.output_spec)


def _arg_names(op_call) -> list[str]:
    return [a.name for a in op_call._schema.arguments if not a.kwarg_only]
