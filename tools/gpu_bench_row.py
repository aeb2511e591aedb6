"""One GPU benchmark row: the real trainer (`titanlab.trainer.Trainer`) in this process, timed.

    python tools/gpu_bench_row.py --out ROW.json [--warmup 3] [--profile-step K]
        [--trace TRACE.json.gz] -- TRAINER_ARGS...

Runs one rank (world size 1, NCCL + gloo process group on this machine) for
`--training.steps` steps of the trainer's own loop and writes a JSON object: the seconds of
each `Trainer.train_step` (forward, backward, clip, optimizer step; the step ends with the
loss's `.item()`, so the GPU work is done), tokens/s and TFLOP/s of the median step after
`--warmup` steps, MFU against the device's dense bf16 peak (`titanlab.metrics`), the last
loss, `torch.cuda.max_memory_allocated` / `max_memory_reserved` and the peak resident set size
(bytes) against the estimator
(`titanlab.planning.memory.estimate_memory`: `peak_tensors` is what the allocator holds, `total` adds
the CUDA context), and, from a `torch.profiler` trace of step `--profile-step`: the SDPA
operators that ran (flash, cuDNN, memory-efficient or math), the GPU-time share of each kind
of kernel and the 15 operators with the most GPU time. An out-of-memory error is written as
`{"error": ...}` with the bytes asked for. `tools/gpu_check.py` runs one child per row.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.gpu_rows import single_rank_env, write_row

KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "cudnn_sdpa")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "_scaled_mm", "matmul")),
    ("nccl", ("nccl",)),
    ("triton (fused)", ("triton",)),
    ("copy/cast", ("copy", "cast", "convert")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def summarize_profile(prof) -> dict:
    """SDPA operators seen, GPU time by kernel kind (ms), and the top operators by GPU time."""
    sdpa = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")})
    by_kind: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.events():
        # GPU-side ranges of annotations (e.g. "Optimizer.step#AdamW.step") are not kernels.
        if e.device_type.name != "CUDA" or getattr(e, "is_user_annotation", False):
            continue
        ms = e.device_time / 1e3 if hasattr(e, "device_time") else e.cuda_time / 1e3
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + ms
        kernels[e.name] = kernels.get(e.name, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {
        "sdpa_ops": sdpa,
        "flash_kernel": sorted({k[:80] for k in kernels if "flash" in k.lower()}),
        "gpu_ms_by_kind": {
            k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "gpu_ms_total": round(sum(by_kind.values()), 3),
        "top_kernels_ms": [[k[:120], round(v, 3)] for k, v in top],
    }


def run(args: argparse.Namespace, trainer_args: list[str]) -> dict:
    import torch

    from titanlab.config.manager import build_config
    from titanlab.distributed.init import destroy_distributed
    from titanlab.distributed.parallelize import param_dtype
    from titanlab.planning.memory import estimate_memory
    from titanlab.trainer import Trainer

    config = build_config(trainer_args)
    trainer = Trainer(config)
    step_s: list[float] = []
    losses: list[float] = []
    profile: dict = {}
    inner = trainer.train_step

    def timed_step(batches):
        start = time.perf_counter()
        if trainer.step == args.profile_step:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=acts) as prof:
                out = inner(batches)
                losses.append(float(out[0]))  # waits for the step to finish on the device
            step_s.append(time.perf_counter() - start)
            profile.update(summarize_profile(prof))
            if args.trace:
                prof.export_chrome_trace(args.trace)
        else:
            out = inner(batches)
            losses.append(float(out[0]))  # waits for the step to finish on the device
            step_s.append(time.perf_counter() - start)
        return out

    trainer.train_step = timed_step  # type: ignore[method-assign]
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        trainer.close()
    est = estimate_memory(trainer.model_args, config, 1, param_dtype(config, trainer.device))
    timed = [t for i, t in enumerate(step_s, 1) if i > args.warmup and i != args.profile_step]
    median = statistics.median(timed)
    tokens = config.training.local_batch_size * config.training.seq_len
    tps = tokens / median
    flops = trainer.metrics.flops_per_token
    peak = trainer.metrics.peak_flops
    result = {
        "step_s": [round(t, 4) for t in step_s],
        "median_step_s": round(median, 4),
        "tps": round(tps, 1),
        "tflops": round(tps * flops / 1e12, 1),
        "mfu": round(tps * flops / peak, 4) if peak else None,
        "peak_flops": peak,
        "flops_per_token": flops,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        # The trainer restarts the allocator's peak counters at every log line; its run peaks
        # are the maxima over those windows.
        "max_allocated": run_peak(trainer, "mem_peak_allocated_gib") if cuda else None,
        "max_reserved": run_peak(trainer, "mem_peak_reserved_gib") if cuda else None,
        "estimate_peak_tensors": est.peak_tensors,
        "estimate_total": est.total,
        "estimate_summary": est.summary(),
        "params": sum(p.numel() for part in trainer.model_parts for p in part.parameters()),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "profile": profile,
    }
    destroy_distributed(barrier=False)
    return result


def run_peak(trainer, key: str) -> int:
    """Bytes: the largest per-window CUDA peak `key` the trainer's metrics logged in this run."""
    return round(trainer.metrics.run_peaks.get(key, 0.0) * 2**30)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where the row's JSON goes")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--profile-step", type=int, default=0, help="step to profile (0: none)")
    p.add_argument("--trace", default="", help="Chrome trace of the profiled step (.json.gz)")
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="turn SDPA's cuDNN backend off (torch then picks its own flash kernel, FA2)",
    )
    args = p.parse_args(argv[:split])
    single_rank_env()
    import torch

    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
        # The SDPA flags are not in torch.compile's on-disk cache keys: compile afresh, or a
        # graph compiled with cuDNN attention by an earlier row would be reused.
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False

    return write_row(args.out, lambda: run(args, argv[split + 1 :]))


if __name__ == "__main__":
    sys.exit(main())
