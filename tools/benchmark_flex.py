"""Masked attention on a GPU: FlexAttention (titanlab's CUDA path: `flex_masks`' block masks,
the sinks through the log-sum-exp) against the SDPA path (dense masks, the chunked sliding
window, the sink as an extra key), one attention layer's forward and backward in bf16, time and
peak memory, at seq 8192 and 32768.

    python tools/benchmark_flex.py [--seqs 8192,32768] [--write] [--json OUT.json]
    python tools/benchmark_flex.py --rehearse      # on a CPU: the rows' forward at 512 tokens,
                                                   # FlexAttention eager

Rows: Llama 3 8B's attention (32 query heads, 8 key-value heads of 128) with documents of
mixed lengths; gpt-oss 20b's (64 heads, 8 key-value heads of 64) on its sliding layers
(window 128, sinks) and its full layers (sinks). Each row times `--steps` calls after
`--warmup` (the compile) with CUDA events, and reads `torch.cuda.max_memory_allocated` above
the inputs. A row that runs out of memory says so. `--write` puts the table in
docs/performance.md (block `flex-attention`); `make gpu-session`'s stage `flex` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from titanlab.models.common import flex_kernel
from titanlab.models.common.attention import Attention
from titanlab.models.common.document_mask import block_causal_mask
from titanlab.models.common.flex_masks import (
    band_block_mask,
    computed_fraction,
    document_block_mask,
)
from titanlab.models.common.rope import precompute_rope_cos_sin
from tools.lib.bench import write_block

ROWS = {  # name: (dim, heads, kv heads, head dim, window, sinks, documents)
    "Llama 3 8B · documents": (4096, 32, 8, 128, None, False, True),
    "gpt-oss 20b · window 128 + sinks": (2880, 64, 8, 64, 128, True, False),
    "gpt-oss 20b · full + sinks": (2880, 64, 8, 64, None, True, False),
}


def documents(seq: int, device) -> torch.Tensor:
    """(1, seq) document ids: lengths cycling through 300, 2000, 700 and 5000 tokens."""
    lengths, ids, doc = [300, 2000, 700, 5000], [], 0
    while len(ids) < seq:
        ids += [doc] * lengths[doc % 4]
        doc += 1
    return torch.tensor([ids[:seq]], device=device)


def inputs(row, seq: int, device):
    """(attention layer, x, cos, sin, flex mask, SDPA mask) of `row` at `seq` tokens."""
    dim, heads, kv, hd, window, sinks, docs = row
    torch.manual_seed(0)
    attn = Attention(dim, heads, kv, hd, None, sinks=sinks, window=window).to(device)
    attn.init_weights(0.02)
    attn.to(torch.bfloat16)
    x = torch.randn(1, seq, dim, device=device, dtype=torch.bfloat16)
    cos, sin = precompute_rope_cos_sin(hd, seq, 500000.0, None, device=device)
    if docs:
        seg = documents(seq, device)
        pos = torch.arange(seq, device=device)[None]
        return (
            attn,
            x,
            cos,
            sin,
            document_block_mask(seg, pos, seg, pos, window),
            block_causal_mask(seg),
        )
    return attn, x, cos, sin, band_block_mask(seq, seq, window, device), None


def measure(attn, x, cos, sin, mask, steps: int, warmup: int, backward: bool) -> dict:
    """Median seconds per call and peak bytes above what was allocated before."""
    cuda = x.device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        begin = time.perf_counter()
        xi = x.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out = attn(xi, cos, sin, mask=mask)
            if backward:
                out.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return {"s": sorted(times)[len(times) // 2], "peak_bytes": peak}


def run(seqs: list[int], steps: int, warmup: int, rehearse: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() and not rehearse else "cpu")
    if rehearse:  # the CPU's compiled FlexAttention returns no log-sum-exp (the sinks need it)
        from torch.nn.attention.flex_attention import flex_attention

        flex_kernel.compiled_flex_attention = lambda: flex_attention
    results = []
    for name, row in ROWS.items():
        for seq in seqs:
            attn, x, cos, sin, flex_mask, dense = inputs(row, seq, device)
            out = {"row": name, "seq": seq, "tiles": computed_fraction(flex_mask)}
            for kernel, mask in (("flex", flex_mask), ("sdpa", dense)):
                try:
                    out[kernel] = measure(attn, x, cos, sin, mask, steps, warmup, not rehearse)
                except torch.OutOfMemoryError:
                    out[kernel] = {"error": "out of memory"}
                    torch.cuda.empty_cache()
            results.append(out)
            print(json.dumps(out), flush=True)
    return results


def table(results: list[dict], device: str) -> str:
    lines = [
        f"Measured with `python tools/benchmark_flex.py` on {device}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}. One attention layer, bf16, batch 1, forward + backward; "
        "median of the timed calls after the compile; peak memory above the inputs.",
        "",
        "| row | seq | tiles computed | FlexAttention ms | SDPA path ms | speed-up | "
        "FlexAttention peak MiB | SDPA path peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        f, s = r["flex"], r["sdpa"]

        def cell(m, key, scale):
            return m["error"] if "error" in m else f"{m[key] * scale:,.1f}"

        speed = f"{s['s'] / f['s']:.2f}×" if "s" in f and "s" in s else "–"
        lines.append(
            f"| {r['row']} | {r['seq']:,} | {100 * r['tiles']:.1f}% | {cell(f, 's', 1e3)} | "
            f"{cell(s, 's', 1e3)} | {speed} | {cell(f, 'peak_bytes', 2**-20)} | "
            f"{cell(s, 'peak_bytes', 2**-20)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rehearse", action="store_true", help="CPU: forward at 512 tokens")
    parser.add_argument("--write", action="store_true", help="docs/performance.md block")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    seqs = [512] if opts.rehearse else [int(s) for s in opts.seqs.split(",")]
    if not opts.rehearse and not torch.cuda.is_available():
        print("benchmark_flex: no CUDA GPU (use --rehearse on a CPU)")
        return 2
    results = run(seqs, opts.steps, opts.warmup, opts.rehearse)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (rehearsal)"
    text = table(results, device)
    print(text)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "results": results}, f, indent=1)
    if opts.write and not opts.rehearse:
        write_block(os.path.join(REPO, "docs", "performance.md"), "flex-attention", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
