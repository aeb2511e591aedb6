"""The ledger's checks of a step's GPU code path (docs/ledger.md, "Gates"), each a number and
what it names:

- `fp32_gemm_share`: the share of GEMM FLOPs (matmuls and attention) computed in fp32, by
  module, against all GEMM FLOPs; a bf16 or float8 run keeps it at most 1%, where the MoE
  routers' fp32 scores (`EXEMPT`) are the allowed exceptions. The fused loss's weight gradient
  summed as fp32 GEMMs (the defect of 2026-11-27: 8.6 TFLOP a step for Llama 3 8B at seq_len
  8192) was 30% of the step's GEMM FLOPs on 11 blocks.
- `attention_matrices`: the tensors an attention op (or the step's mask building) makes with a
  (queries × keys) plane of a whole sequence, seq_len/cp × seq_len or more: a score matrix, a
  dense mask or its additive bias. A fused attention kernel (flash, cuDNN, FlexAttention's
  block-sparse one) makes none; none at or above 64 MiB may exist.
- `host_syncs`: the host syncs of the step (`.item()`, `.tolist()`, `.cpu()`: the recorder's
  "sync" ops) other than the by-design ones (`ALLOWED_SYNCS`: expert parallel's split sizes,
  which the all-to-all needs on the host, as torchtitan's does); a step has none.
- `hidden_all_to_alls`: seconds of all-to-alls (expert parallel's dispatch and combine) the
  price does not count as exposed, beyond what the compute recorded between each and its wait
  (the shared expert beside the combine) can hide: none.
- `fallback_kernels`: ops of a PyTorch fallback where the GPU runs a fused kernel
  (`FALLBACKS`: the gated delta rule's triangular solves, which fla's kernel replaces).
- `unfused_in_compiled_blocks`: under `compile.enable`, the share of the step the blocks spend
  in pointwise kernels outside Inductor's fused regions (a backend that does not fuse,
  `compile.backend = "aot_eager"`; a graph break), MoE layers aside (they run eagerly by
  design: `titanlab.distributed.compile.apply_compile`); at most 1%.
"""

from __future__ import annotations

from collections import defaultdict

import re

import torch

from titanlab.ledger.run import Ledger

MAX_FP32_GEMM_SHARE = 0.01
EXEMPT = ("router",)
"""Module names whose fp32 GEMMs are by design: an MoE router scores tokens in fp32 (Qwen3-MoE,
DeepSeek-V3, gpt-oss as published), a (tokens × dim) by (dim × experts) product."""


def fp32_gemm_share(ledger: Ledger) -> tuple[float, dict[str, float]]:
    """(share of all GEMM FLOPs computed in fp32 outside `EXEMPT` modules, {module: its share}
    for every module with fp32 GEMMs, exempt ones included)."""
    total = 0
    fp32: dict[str, int] = defaultdict(int)
    for op in ledger.ops:
        if op.kind not in ("gemm", "attention"):
            continue
        total += op.flops
        if op.dtype in ("float32", "float64"):
            fp32[op.module] += op.flops
    total = total or 1
    by_module = {m: f / total for m, f in sorted(fp32.items(), key=lambda kv: -kv[1])}
    counted = sum(s for m, s in by_module.items() if not any(e in m for e in EXEMPT))
    return counted, by_module


MAX_ATTENTION_MATRIX_BYTES = 64 * 2**20


def _scores(op, made: set[int]) -> bool:
    """Whether `op`, run in an attention module, makes part of a score or mask computation:
    a matmul (q kᵀ; not a convolution), a tensor made from nothing (`ones`, `full`), a bool
    one (a mask compared from positions), or one computed from such a tensor (the softmax,
    the masking, a cast)."""
    gemm = op.kind == "gemm" and "convolution" not in op.op
    return gemm or not op.inputs or op.dtype == "bool" or any(i in made for i in op.inputs)


def attention_matrices(ledger: Ledger, limit: int = MAX_ATTENTION_MATRIX_BYTES) -> list[str]:
    """Each op output of at least `limit` bytes whose last two dims are a (queries × keys)
    plane of a whole sequence (both between seq_len / cp and seq_len + 1, a sink's extra key):
    made outside every module (where the step builds its masks), or in an attention module's
    own ops (not its projections') as a score or mask (`_scores`), so that a tensor of another
    kind whose dims happen to match (Qwen3.5's short convolution over 8192 channels at seq_len
    8192) is not one; as "op module phase shape dtype MiB", largest first."""
    rows = ledger.seq_len // max(ledger.cp, 1)
    found = []
    made: set[int] = set()  # tensors of a score or mask computation
    for op in ledger.ops:
        if op.kind == "view":
            if op.inputs and op.inputs[0] in made:
                made.update(op.outputs)
            continue
        if len(op.shape) < 2 or not op.dtype:
            continue
        in_attention = "attention" in op.module.rsplit(".", 1)[-1]
        if not (in_attention or op.module == ""):
            continue
        q, k = op.shape[-2:]
        if not (rows <= q <= ledger.seq_len + 1 and rows <= k <= ledger.seq_len + 1):
            continue
        if in_attention and not _scores(op, made):
            continue
        made.update(op.outputs)
        size = (
            torch.Size(op.shape).numel()
            * torch.empty((), dtype=getattr(torch, op.dtype)).element_size()
        )
        if size >= limit:
            found.append((size, f"{op.op} {op.module or '-'} {op.phase} {tuple(op.shape)} "
                                f"{op.dtype} {size / 2**20:.0f} MiB"))  # fmt: skip
    return [line for _, line in sorted(found, key=lambda f: -f[0])]


ALLOWED_SYNCS = ("expert_parallel.splits",)
"""Host reads a step makes by design: expert parallel's split sizes (one read of the counts
each MoE layer's dispatch, recomputation included), which `all_to_all_single` takes on the
host (torchtitan's expert parallel reads them the same way)."""


def host_syncs(ledger: Ledger) -> dict[str, int]:
    """{"what module phase": count} of the step's host syncs outside `ALLOWED_SYNCS`, most
    frequent first (block numbers as `*`)."""
    found: dict[str, int] = defaultdict(int)
    for op in ledger.ops:
        if op.kind == "sync" and op.op not in ALLOWED_SYNCS:
            found[f"{op.op} {_LAYER.sub('*', op.module) or '-'} {op.phase}"] += 1
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def hidden_all_to_alls(ledger: Ledger) -> tuple[float, float, float]:
    """(seconds of all-to-alls the step's price leaves unexposed, the most that the compute
    between each all-to-all and its wait (`titanlab.ledger.price.waits`) can hide, seconds of
    all the step's all-to-alls). The unexposed part is the step's exposed time less what the
    same step without them exposes (priced again by `titanlab.ledger.price.price`); it must
    not exceed the second figure."""
    from titanlab.ledger.price import price, waits

    ops, seconds = ledger.ops, ledger.priced.seconds
    a2a = [
        i for i, op in enumerate(ops) if op.kind == "collective" and op.collective == "all_to_all"
    ]
    total = sum(seconds[i] for i in a2a)
    if not a2a:
        return 0.0, 0.0, 0.0
    wait_of = waits(ops)

    def window(i: int) -> float:  # the compute recorded between all-to-all i and its wait
        between = range(i + 1, wait_of.get(i, i + 1))
        return sum(seconds[k] for k in between if ops[k].kind != "collective")

    beside = sum(min(seconds[i], window(i)) for i in a2a)
    skip = set(a2a)
    rest = price([op for i, op in enumerate(ops) if i not in skip], ledger.device,
                 ledger.group_dims)  # fmt: skip
    hidden = total + rest.exposed_comm_s - ledger.priced.exposed_comm_s
    return max(hidden, 0.0), beside, total


FALLBACKS = {
    "aten.linalg_solve_triangular.default": "the gated delta rule in PyTorch where the GPU "
    "runs fla's chunk_gated_delta_rule (titanlab.models.common.delta_rule_kernel)",
}
"""Ops that mark a PyTorch fallback of a kernel the GPU has, and what they mean."""


def fallback_kernels(ledger: Ledger) -> dict[str, str]:
    """{what the fallback is: "N calls in modules, X ms of those modules' own ops"} for each
    `FALLBACKS` op the step runs."""
    found: dict[str, set[str]] = defaultdict(set)
    calls: dict[str, int] = defaultdict(int)
    for op in ledger.ops:
        if op.op in FALLBACKS:
            found[op.op].add(op.module)
            calls[op.op] += 1
    out = {}
    for name, modules in found.items():
        spent = sum(s for op, s in zip(ledger.ops, ledger.priced.seconds)
                    if op.module in modules and op.kind != "view")  # fmt: skip
        where = ", ".join(sorted({_LAYER.sub("*", m) for m in modules}))
        out[FALLBACKS[name]] = f"{calls[name]} {name} in {where}, {spent * 1e3:.1f} ms of their ops"
    return out


MAX_UNFUSED_SHARE = 0.01
_BLOCK = re.compile(r"^(layers|mtp)\.\d+\.")
_LAYER = re.compile(r"(?<=^layers\.)\d+|(?<=^mtp\.)\d+")


def unfused_in_compiled_blocks(ledger: Ledger) -> tuple[float, dict[str, float]]:
    """(share of the step's seconds in pointwise kernels of a compiled run's blocks outside
    fused regions, {"op module": seconds} of them, largest first); (0, {}) when the blocks are
    not compiled. MoE layers (a module holding `experts`) are left out: eager by design."""
    if not ledger.compiled_blocks:
        return 0.0, {}
    moe = {op.module.rsplit(".experts", 1)[0] for op in ledger.ops if ".experts" in op.module}
    found: dict[str, float] = defaultdict(float)
    for op, s in zip(ledger.ops, ledger.priced.seconds):
        if op.kind not in ("pointwise", "other") or op.region is not None:
            continue
        if op.phase not in ("forward", "backward") or not _BLOCK.match(op.module):
            continue
        if any(op.module == m or op.module.startswith(m + ".") for m in moe):
            continue
        found[f"{op.op} {_LAYER.sub('*', op.module)}"] += s
    total = sum(found.values())
    return total / ledger.priced.step_s, dict(sorted(found.items(), key=lambda kv: -kv[1]))


def _top(items: dict, fmt, n: int = 3) -> str:
    return ", ".join(fmt(k, v) for k, v in list(items.items())[:n])


def check(ledger: Ledger) -> dict[str, str]:
    """{gate: one line naming what failed and its cause} for each gate above `ledger` fails;
    {} when it passes them all."""
    out = {}
    share, by_module = fp32_gemm_share(ledger)
    if share > MAX_FP32_GEMM_SHARE:
        top = _top(by_module, lambda m, v: f"{m or '-'} {v:.1%}")
        out["fp32_gemm_share"] = (f"fp32 GEMMs are {share:.1%} of the step's GEMM FLOPs (limit "
                                  f"{MAX_FP32_GEMM_SHARE:.0%}), by module: {top}")  # fmt: skip
    found = attention_matrices(ledger)
    if found:
        out["attention_matrices"] = (
            f"{len(found)} attention tensors of a whole (queries × keys) plane of at least "
            f"{MAX_ATTENTION_MATRIX_BYTES // 2**20} MiB, an unfused attention path (explicit "
            f"score matrices): {found[0]}"
        )
    syncs = host_syncs(ledger)
    if syncs:
        top = _top(syncs, lambda k, n: f"{k} ×{n}")
        out["host_syncs"] = f"{sum(syncs.values())} host syncs in the step: {top}"
    hidden, beside, total = hidden_all_to_alls(ledger)
    if hidden > beside + 1e-9:
        out["hidden_all_to_alls"] = (
            f"{hidden * 1e3:.1f} of the {total * 1e3:.1f} ms of all-to-alls (expert parallel's "
            f"dispatch and combine) priced as hidden behind the compute; the ops before their "
            f"waits hide at most {beside * 1e3:.1f}"
        )
    for what, where in fallback_kernels(ledger).items():
        out["fallback_kernels"] = f"{what}: {where}"
    share, unfused = unfused_in_compiled_blocks(ledger)
    if share > MAX_UNFUSED_SHARE:
        top = _top(unfused, lambda k, v: f"{k} {v * 1e3:.1f} ms")
        out["unfused_in_compiled_blocks"] = (
            f"compiled blocks spend {share:.1%} of the step in pointwise kernels outside "
            f"Inductor's fused regions (limit {MAX_UNFUSED_SHARE:.0%}; a compile backend that "
            f"does not fuse, or a graph break): {top}"
        )
    return out


def slower_than(ledger: Ledger, baseline: Ledger, limit: float, name: str) -> str:
    """'' when `ledger`'s step is at most `limit` × `baseline`'s (named `name`), else one line:
    the ratio and the ops that cost the difference, by op and dtype over all phases (a GEMM
    moved from backward to forward is no difference)."""
    ratio = ledger.priced.step_s / baseline.priced.step_s
    if ratio <= limit:
        return ""
    spent: dict[str, float] = defaultdict(float)
    for sign, side in ((1, ledger), (-1, baseline)):
        for op, s in zip(side.ops, side.priced.seconds):
            if op.kind != "view":
                spent[f"{op.op} {op.dtype}"] += sign * s
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:3]
    costs = ", ".join(f"{s * 1e3:+.1f} ms {what}" for what, s in top)
    return f"the step is {ratio:.3f}× {name}'s (limit {limit}×): {costs}"
