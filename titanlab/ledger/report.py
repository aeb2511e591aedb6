"""What a ledger says: the predicted step, tokens/s and MFU, FLOPs by dtype, where the time goes
by phase and by op (the ops of every block summed under one name: `layers.*.attention`), and
the same as JSON."""

from __future__ import annotations

import json
import re
from collections import defaultdict

from titanlab.ledger.run import Ledger

GIB = 2**30
_LAYER = re.compile(r"^(layers|mtp)\.\d+")


def op_rows(ledger: Ledger) -> list[dict]:
    """The ops grouped by (op, module with block numbers as `*`, phase, dtype), most expensive
    first: each row's seconds, share (of the step's compute; a collective's, of all the
    collectives' seconds), calls, FLOPs and bytes."""
    rows: dict[tuple, dict] = defaultdict(
        lambda: {"seconds": 0.0, "calls": 0, "flops": 0, "bytes": 0}
    )
    collectives = set()
    for op, s in zip(ledger.ops, ledger.priced.seconds):
        if op.kind == "view":
            continue
        if op.kind == "collective":
            collectives.add(op.op)
        key = (op.op, _LAYER.sub(r"\1.*", op.module), op.phase, op.dtype)
        row = rows[key]
        row["seconds"] += s
        row["calls"] += 1
        row["flops"] += op.flops
        row["bytes"] += op.bytes_read + op.bytes_written
    compute = ledger.priced.compute_s or 1.0
    comm = ledger.priced.comm_s or 1.0
    out = []
    for (op, module, phase, dtype), row in rows.items():
        whole = comm if op in collectives else compute
        out.append({"op": op, "module": module, "phase": phase, "dtype": dtype, **row,
                    "share": row["seconds"] / whole})  # fmt: skip
    return sorted(out, key=lambda r: -r["seconds"])


def gemm_flops_by_dtype(ledger: Ledger) -> dict[str, int]:
    """FLOPs of the GEMMs (matmuls and attention) by compute dtype."""
    out: dict[str, int] = defaultdict(int)
    for op in ledger.ops:
        if op.kind in ("gemm", "attention"):
            out[op.dtype] += op.flops
    return dict(out)


def flex_tiles(ledger: Ledger) -> dict[str, float]:
    """{attention module: the share of its (128 × 128) tiles FlexAttention computes} for each
    module whose forward runs FlexAttention (a window's band, a causal or document mask's half;
    under the alltoall ring, the mean of its shards)."""
    shares: dict[str, list[float]] = defaultdict(list)
    for op in ledger.ops:
        if op.tiles is not None and op.phase == "forward":
            shares[op.module].append(op.tiles)
    return {m: sum(v) / len(v) for m, v in sorted(shares.items())}


def summary(ledger: Ledger) -> dict:
    """The ledger's figures: step seconds, tokens/s, MFU against the dense bf16 peak, memory
    peak (GiB), FLOPs by dtype, seconds by phase, the collectives' seconds, FlexAttention's
    computed tiles by module."""
    p = ledger.priced
    phases: dict[str, float] = defaultdict(float)
    for op, s in zip(ledger.ops, p.seconds):
        if op.kind != "collective":
            phases[op.phase] += s
    peak = ledger.device.flops("bfloat16")
    return {
        "device": ledger.device.name,
        "run": ledger.config_summary,
        "step_s": p.step_s,
        "compute_s": p.compute_s,
        "comm_s": p.comm_s,
        "exposed_comm_s": p.exposed_comm_s,
        "contention_s": p.contention_s,
        "step_range_s": [p.perfect_s, p.serialized_s],
        "tokens_per_s": ledger.tokens / p.step_s,
        "mfu": ledger.model_flops / p.step_s / peak,
        "memory_peak_gib": ledger.memory_peak / GIB,
        "memory_capacity_gib": ledger.device.memory_bytes / GIB,
        "gemm_flops_by_dtype": gemm_flops_by_dtype(ledger),
        "seconds_by_phase": dict(phases),
        "host_syncs": sum(op.kind == "sync" for op in ledger.ops),
        "flex_tiles": flex_tiles(ledger),
    }


def render(ledger: Ledger, top: int = 20) -> str:
    """The ledger as text: its summary, then the `top` most expensive op groups."""
    s = summary(ledger)
    flops = ", ".join(f"{d} {f / 1e12:.2f}" for d, f in sorted(s["gemm_flops_by_dtype"].items()))
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s["seconds_by_phase"].items())
    low, high = s["step_range_s"]
    span = ""
    if high > low * 1.0005:  # collectives that may overlap: the assumptions' range
        span = (f"; range {low * 1e3:.1f} (perfect overlap) … {high * 1e3:.1f} ms (serialized), "
                f"MFU {100 * s['mfu'] * s['step_s'] / high:.1f}–"
                f"{100 * s['mfu'] * s['step_s'] / low:.1f}%; assumed: the first gather and "
                "last reduction exposed, the compute beside a collective slowed "
                f"{s['contention_s'] * 1e3:.1f} ms (titanlab.ledger.price.Overlap)")  # fmt: skip
    over = ""
    if s["memory_peak_gib"] > s["memory_capacity_gib"]:
        over = f" — ABOVE the {s['device']}'s {s['memory_capacity_gib']:.1f} GiB: it would not fit"
    lines = [
        f"ledger: {s['run']}, priced for {s['device']}",
        f"step {s['step_s'] * 1e3:.1f} ms (compute {s['compute_s'] * 1e3:.1f} ms, "
        f"collectives {s['comm_s'] * 1e3:.1f} ms of which {s['exposed_comm_s'] * 1e3:.1f} ms "
        f"exposed){span}; {s['tokens_per_s']:,.0f} tokens/s per rank; MFU "
        f"{100 * s['mfu']:.1f}%; memory peak (estimate) {s['memory_peak_gib']:.1f} GiB{over}",
        f"GEMM TFLOP by dtype: {flops}; ms by phase: {phases}; host syncs: {s['host_syncs']}",
        *_tiles_line(s["flex_tiles"]),
        "",
        "| ms | share | calls | op | module | phase | dtype | TFLOP | GB |",
        "|---:|---:|---:|---|---|---|---|---:|---:|",
    ]
    for r in op_rows(ledger)[:top]:
        lines.append(
            f"| {r['seconds'] * 1e3:.2f} | {100 * r['share']:.1f}% | {r['calls']} | "
            f"`{r['op']}` | {r['module'] or '-'} | {r['phase']} | {r['dtype']} | "
            f"{r['flops'] / 1e12:.3f} | {r['bytes'] / 1e9:.2f} |"
        )
    return "\n".join(lines)


def _tiles_line(tiles: dict[str, float]) -> list[str]:
    """One line: the layers by the share of FlexAttention tiles they compute (none: no line)."""
    if not tiles:
        return []
    groups: dict[str, int] = defaultdict(int)
    for share in tiles.values():
        groups[f"{100 * share:.1f}%"] += 1
    kinds = ", ".join(f"{share} in {n} layer{'s' if n > 1 else ''}" for share, n in groups.items())
    return [f"FlexAttention tiles computed (of 128×128): {kinds}"]


def to_json(ledger: Ledger) -> str:
    """The summary and every op group, as JSON."""
    return json.dumps({"summary": summary(ledger), "ops": op_rows(ledger)}, indent=1)


def differences(ledger: Ledger, baseline: Ledger, top: int = 12) -> list[tuple[float, str]]:
    """Where `ledger`'s step spends more or less time than `baseline`'s: (seconds of ledger −
    seconds of baseline, "op phase dtype") per op, phase and dtype (modules aside: the two
    steps may name theirs differently), largest differences first."""
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for i, side in enumerate((ledger, baseline)):
        for op, s in zip(side.ops, side.priced.seconds):
            if op.kind != "view":
                spent[f"{op.op} {op.phase} {op.dtype}"][i] += s
    rows = [(a - b, key) for key, (a, b) in spent.items()]
    return sorted(rows, key=lambda r: -abs(r[0]))[:top]
