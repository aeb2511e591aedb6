"""Measure the machine at hand into a cluster profile (`python -m titanlab.plan --calibrate`).

Each rate comes from a short timed run of the job's own shapes, one thread per rank as the
ranks run:
- matmul peak: one block's Linear layers, forward and backward, at the job's tokens per
  microbatch (the GEMMs' achieved FLOP/s; `Efficiency.matmul` is then 1);
- attention efficiency: SDPA forward and backward (causal) at the job's heads and sequence,
  its 12·H·Q·s FLOPs per token and layer ÷ time ÷ the matmul peak;
- pointwise share: a whole block's forward and backward minus its GEMMs and attention, ÷ the
  GEMM time;
- memory bandwidth: a fused AdamW step over the model's parameter count (28 bytes each);
- split backward: what a block's backward over a pipeline microbatch costs beyond a whole one
  when split into torch's input and weight halves (zero-bubble schedules);
- tensor parallel's overhead: a block's forward and backward under TP 2 in each pair of ranks
  beyond half the unsplit block's time and its collectives (`titanlab.planning.calibrate_tp`);
- FSDP2's overhead per all-gather and per reduce-scatter beyond their α–β time: a small model
  under DDP, ZeRO 2 and ZeRO 3 over all the ranks (`titanlab.planning.calibrate_fsdp`);
- link α and β: all-reduces of 256 KiB and 16 MiB between 2 processes (gloo on CPU, NCCL on 2+
  GPUs), solved from t = 2(n−1)/n·M/β + 2(n−1)·α at n = 2, each t the median over 100
  iterations of (compute + all-reduce) − (the same compute alone), timed back to back; on CPU
  with more ranks than cores, measured with all the ranks running, in pairs, computing between
  all-reduces (α is then mostly the wait for the partner to get a core).
On CPU the ranks share the cores (`Cluster.shared_cores`). Units as `Cluster`'s.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.planning.cluster import Cluster, Efficiency

REPEATS = 5
SIZES = (256 * 2**10, 16 * 2**20)
"""All-reduce buffer sizes in bytes (fp32 elements × 4)."""


def _seconds(
    fn: Callable[[], object], device: torch.device, repeats: int = REPEATS, warm_up: bool = True
) -> float:
    """Median wall seconds of `fn`, after one warm-up call unless `warm_up` is false."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _fwd_bwd(module: Callable, *inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = module(*inputs)
        out.float().sum().backward()

    return run


def _block_rates(model_args, tokens: int, seq: int, dtype, device) -> dict[str, float]:
    """(matmul FLOP/s, attention ÷ matmul efficiency, pointwise share) of one block."""
    from titanlab.models.common.shortened import shortened
    from titanlab.models.registry import build_model

    args = dataclasses.replace(shortened(model_args, 1), max_seq_len=seq)
    with torch.device(device):
        model = build_model(args).to(dtype)
    layers = cast(nn.ModuleDict, model.layers)
    block = next(iter(layers.values()))
    batch = max(tokens // seq, 1)
    x = torch.randn(batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    rope_cos, rope_sin = cast(torch.Tensor, model.rope_cos), cast(torch.Tensor, model.rope_sin)
    cos, sin = rope_cos[:seq], rope_sin[:seq]
    block_s = _seconds(_fwd_bwd(block, x, cos, sin), device)

    gemm_s, gemm_flops = 0.0, 0.0
    for lin in (m for m in block.modules() if isinstance(m, nn.Linear)):
        inp = torch.randn(batch * seq, lin.in_features, device=device, dtype=dtype)
        inp.requires_grad_(True)
        gemm_s += _seconds(_fwd_bwd(lin, inp), device)
        gemm_flops += 6 * lin.in_features * lin.out_features * batch * seq
    heads, head_dim = args.n_heads, args.head_dim
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn_like(q).requires_grad_(True) for _ in range(2))
    attn_s = _seconds(_fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, is_causal=True), q, k, v), device)  # fmt: skip
    attn_flops = 12 * heads * head_dim * seq * batch * seq
    peak = gemm_flops / gemm_s
    return {
        "peak": peak,
        "attention": min(1.0, attn_flops / attn_s / peak),
        "pointwise": max(0.0, (block_s - gemm_s - attn_s) / gemm_s),
    }


def _split_backward_s(model_args, tokens: int, seq: int, dtype, device) -> float:
    """Seconds a block's backward over `tokens` (a pipeline microbatch) takes beyond a whole
    backward when split into torch's input and weight halves, as a zero-bubble schedule runs a
    middle stage's: the median of `SPLIT_REPEATS` back-to-back pairs (≥ 0)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from titanlab.models.common.shortened import shortened
    from titanlab.models.registry import build_model

    args = dataclasses.replace(shortened(model_args, 1), max_seq_len=seq)
    with torch.device(device):
        model = build_model(args).to(dtype)
    block = next(iter(cast(nn.ModuleDict, model.layers).values()))
    batch = max(tokens // seq, 1)
    x = torch.randn(batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    rope_cos, rope_sin = cast(torch.Tensor, model.rope_cos), cast(torch.Tensor, model.rope_sin)
    cos, sin = rope_cos[:seq], rope_sin[:seq]

    def whole() -> None:
        out = block(x, cos, sin)
        out.backward(torch.ones_like(out))

    def split() -> None:
        out = block(x, cos, sin)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
        stage_backward_weight(block.parameters(), groups)

    whole()  # warm-up
    split()
    return max(0.0, statistics.median(
        _seconds(split, device, 1, warm_up=False) - _seconds(whole, device, 1, warm_up=False)
        for _ in range(SPLIT_REPEATS)
    ))  # fmt: skip


SPLIT_REPEATS = 15


def _optimizer_bandwidth(n_params: int, device) -> float:
    """Bytes per second of a fused AdamW step (28 bytes per fp32 parameter)."""
    n = min(n_params, 64 * 2**20)  # rates settle well before; bounds the calibration's memory
    p = nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return 28 * n / _seconds(opt.step, device)


def _link_worker(rank: int, world: int, port: int, backend: str, out: dict, job=None) -> None:
    """Rank `rank` of `world` processes in pairs (0-1, 2-3, ...): for each of `SIZES`,
    `LINK_REPEATS` iterations that each time a burst of compute (a matmul loop of about
    `BURST_S`) alone and the same burst followed by an all-reduce within the pair, back to back,
    so a drift of the machine falls on both; rank 0 reports the median of the differences
    (seconds an all-reduce adds to an iteration). With `job`, then times a TP block in each
    pair and FSDP2's collectives over all the ranks (`calibrate_tp`, `calibrate_fsdp`)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
        pair = pairs[rank // 2]
        a = torch.randn(128, 128, device=device)
        per = _seconds(lambda: a @ a, device, repeats=20)
        bursts = max(1, round(BURST_S / per)) if world > 2 else 0

        def timed(comm: bool, buf: torch.Tensor) -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin = time.perf_counter()
            for _ in range(bursts):
                a @ a
            if comm:
                dist.all_reduce(buf, group=pair)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - begin

        for size in SIZES:
            buf = torch.ones(size // 4, device=device)
            dist.barrier()
            timed(True, buf)  # warm-up: the pair's first collective connects
            added = [timed(True, buf) - timed(False, buf) for _ in range(LINK_REPEATS)]
            if rank == 0:
                out[size] = statistics.median(added)
        if job is not None:  # (model_args, tokens, seq, dtype): a TP block in each pair,
            from titanlab.planning.calibrate_fsdp import fsdp_step_seconds  # FSDP over all
            from titanlab.planning.calibrate_tp import tp_block_seconds

            model_args, tokens, seq, dtype = job
            times = tp_block_seconds(model_args, tokens, seq, dtype, device, pair)
            fsdp = fsdp_step_seconds(model_args, tokens, seq, dtype, device, dist.group.WORLD)
            if rank == 0:
                out["tp"], out["fsdp"] = times, fsdp
    finally:
        dist.destroy_process_group()


LINK_REPEATS = 100
"""Paired iterations per all-reduce size (the median difference is taken)."""
BURST_S = 5e-3
"""Compute between two all-reduces when the ranks share cores: long enough that the pair
partner is rarely the process running, as in a training step."""


def _link(device, nproc: int, job=None) -> dict[str, float]:
    """{"alpha": seconds, "beta": bytes/s} of an all-reduce between 2 processes of this machine,
    solved from t = M/β + 2α (n = 2). With more ranks than cores (`nproc` > cores, CPU) all
    `nproc` ranks run at once, in pairs, computing between all-reduces as a training step does:
    α then includes the wait for the partner to be scheduled, and the time taken from the
    others. With `job` (model_args, tokens, seq, dtype) also "tp_block_s", what a TP-2 block
    adds beyond its FLOPs and collectives (`titanlab.planning.calibrate_tp`), and
    "fsdp_gather_s" / "fsdp_reduce_s", what FSDP2 adds per all-gather and reduce-scatter
    (`titanlab.planning.calibrate_fsdp`)."""
    import socket

    import torch.multiprocessing as mp

    backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() > 1 else "gloo"
    shared = device.type == "cpu" and nproc > (os.cpu_count() or 1)
    world = 2 * (nproc // 2) if shared else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_link_worker, args=(world, port, backend, out, job), nprocs=world)
        small, large = (out[n] for n in SIZES)
        t_tp, t_plain = out.get("tp", (0.0, 0.0))
        fsdp = out.get("fsdp")
    beta = (SIZES[1] - SIZES[0]) / max(large - small, 1e-9)
    alpha = max((small - SIZES[0] / beta) / 2, 1e-7)
    got = {"alpha": alpha, "beta": beta}
    if job is None:
        return got
    from titanlab.planning.calibrate_fsdp import fsdp_overheads, unit_params
    from titanlab.planning.calibrate_tp import tp_overhead_s

    model_args, tokens, _, dtype = job
    elem = torch.finfo(dtype).bits // 8
    got["tp_block_s"] = tp_overhead_s(t_tp, t_plain, 2, tokens, model_args.dim, elem, alpha, beta)
    got["fsdp_gather_s"], got["fsdp_reduce_s"] = fsdp_overheads(
        cast(tuple, fsdp), world, unit_params(model_args), elem, 4, alpha, beta
    )
    return got


def calibrate(config, model_args, nproc: int) -> Cluster:
    """A profile of this machine for `nproc` ranks running `config`'s job (see the module
    docstring): one node of `nproc` devices. Takes about a minute on CPU."""
    from titanlab.distributed.parallelize import param_dtype
    from titanlab.models.common.counting import count_params
    from titanlab.planning.memory import _meta_model, available_bytes_per_rank

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = param_dtype(config, device)
        seq = config.training.seq_len
        tokens = config.training.local_batch_size * seq
        rates = _block_rates(model_args, tokens, seq, dtype, device)
        bandwidth = _optimizer_bandwidth(count_params(_meta_model(model_args)), device)
        microbatch = config.parallelism.pipeline_parallel_microbatch_size * seq
        split_s = _split_backward_s(model_args, microbatch, seq, dtype, device)
        job = (model_args, tokens, seq, dtype) if nproc >= 2 else None
        link = _link(device, nproc, job)
    finally:
        torch.set_num_threads(threads)
    memory, _ = available_bytes_per_rank(nproc)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return Cluster(
        name=f"calibrated {device.type}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        devices_per_node=nproc,
        memory_bytes=float(memory),
        peak_flops={name[dtype]: rates["peak"]},
        memory_bandwidth=bandwidth,
        intra_bandwidth=link["beta"],
        inter_bandwidth=link["beta"],
        intra_latency=link["alpha"],
        inter_latency=link["alpha"],
        efficiency=Efficiency(
            matmul=1.0,
            attention=rates["attention"],
            optimizer=1.0,
            pointwise=rates["pointwise"],
            link=1.0,
        ),
        shared_cores=(os.cpu_count() or 1) if device.type == "cpu" else 0,
        device_type=device.type,
        split_backward_s=split_s,
        tp_block_s=link.get("tp_block_s", 0.0),
        fsdp_gather_s=link.get("fsdp_gather_s", 0.0),
        fsdp_reduce_s=link.get("fsdp_reduce_s", 0.0),
    )
