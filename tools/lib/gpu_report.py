"""The Markdown report of `tools/gpu_check.py`: machine, GPU tests, benchmark rows, profile."""

from __future__ import annotations

import datetime

GIB = 2**30


def estimate_error(row: dict) -> float:
    """Relative error of `max_memory_allocated` against the estimate (0.05 = 5% above)."""
    return row["max_allocated"] / row["estimate_peak_tensors"] - 1


def render_report(
    info: dict, tests: list[dict], summary: str, layers: int, rows: list, seconds: float
) -> str:
    """The whole report; its first two lines are the title and a blank line."""
    out = [
        "# GPU check",
        "",
        f"Device: {info['gpu']} ({info['memory'] / GIB:.1f} GiB, compute capability "
        f"{info['capability']}, {info['sms']} SMs), driver {info['driver']}; torch "
        f"{info['torch']} (CUDA {info['cuda']}), Python {info['python']}; "
        f"{datetime.date.today()}; `make gpu-check` took {seconds / 60:.1f} min.",
        "",
    ]
    if info["missing"]:
        out += ["Missing packages: " + "; ".join(info["missing"]) + ".", ""]
    out += _tests(tests, summary)
    if rows:
        out += _rows(layers, rows)
    return "\n".join(out) + "\n"


def _tests(tests: list[dict], summary: str) -> list[str]:
    out = [f"## GPU tests (`pytest -m gpu`): {summary}", ""]
    if not tests:
        return out
    out += ["| test | result | s | note |", "| --- | --- | --- | --- |"]
    for t in tests:
        out.append(f"| `{t['name']}` | {t['outcome']} | {t['s']:.1f} | {_cell(t['msg'])} |")
    return out + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(layers: int, rows: list) -> list[str]:
    out = [
        "## Llama 3 8B-shaped blocks, 1 GPU",
        "",
        f"The trainer (`tools/gpu_bench_row.py`) on Llama 3.1 8B's dims with {layers} of its 32 "
        "blocks (as many as the estimator fits with AC none in bf16), vocab 128256, seq 8192, "
        "local batch 1, AdamW, the bundled corpus; median of the steps after the warm-up. "
        "MFU = tokens/s × training FLOPs/token ÷ the dense bf16 peak. Memory: "
        "`max_memory_allocated` against the estimator's tensor peak.",
        "",
        "| row | step s | tokens/s | TFLOP/s | MFU | vs bf16 | SDPA op | allocated GiB | "
        "estimate GiB | est. error | loss step 1 → last |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {}
    for row, d in rows:
        if "error" not in d and row.is_baseline:
            base.setdefault(row.ac, d["tps"])
    for row, d in rows:
        if "error" in d:
            out.append(f"| {row.name} | {_cell(d['error'])} |" + " |" * 9)
            continue
        ref = base.get(row.ac)
        ratio = f"{d['tps'] / ref:.2f}×" if ref else "n/a"
        ops = ", ".join(
            o.replace("aten::_scaled_dot_product_", "")
            for o in d["profile"].get("sdpa_ops", [])
            if not o.endswith("_backward")
        )
        err = estimate_error(d)
        mfu = f"{100 * d['mfu']:.1f}%" if d.get("mfu") else "n/a"
        out.append(
            f"| {row.name} | {d['median_step_s']:.3f} | {d['tps']:,.0f} | {d['tflops']:.0f} | "
            f"{mfu} | {ratio} | {ops or 'none seen'} | {d['max_allocated'] / GIB:.2f} | "
            f"{d['estimate_peak_tensors'] / GIB:.2f} | {100 * err:+.1f}% | "
            f"{d['loss_first']:.3f} → {d['loss_last']:.3f} |"
        )
    out += ["", "GPU time of one profiled step by kernel kind (ms):", ""]
    kinds = sorted({k for _, d in rows for k in d.get("profile", {}).get("gpu_ms_by_kind", {})})
    out += ["| row | " + " | ".join(kinds) + " | total |", "| --- |" + " --- |" * (len(kinds) + 1)]
    for row, d in rows:
        prof = d.get("profile", {})
        if not prof:
            continue
        cells = [f"{prof['gpu_ms_by_kind'].get(k, 0):.0f}" for k in kinds]
        out.append(f"| {row.name} | " + " | ".join(cells) + f" | {prof['gpu_ms_total']:.0f} |")
    first = next((d for _, d in rows if d.get("profile")), None)
    if first:
        out += ["", "Top kernels of the first row's profiled step (ms):", ""]
        out += ["| kernel | ms |", "| --- | --- |"]
        out += [f"| `{_cell(k)}` | {ms:.1f} |" for k, ms in first["profile"]["top_kernels_ms"]]
    return out + [""]
