"""What `python -m titanlab.plan` prints and writes: the ranked table of layouts, one layout's
arithmetic (`--explain`) and its config file (`--apply`); `titanlab.planning.planner` ranks them.
Raises ConfigError (one line) for bad input."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from titanlab.config.job_config import ConfigError
from titanlab.planning.compute_costs import ComputeCosts
from titanlab.planning.memory import GIB
from titanlab.planning.planner import Candidate

logger = logging.getLogger(__name__)


def run(
    opts: argparse.Namespace,
    rest: list[str],
    priced: Callable[[list[str], str], Callable[[str, int], ComputeCosts]] | None = None,
) -> int:
    """`python -m titanlab.plan` with its own options `opts` and the trainer's `rest`; on a GPU
    profile `priced(rest, opts.cluster)` gives the compute costs by AC mode and ep (the per-op
    ledger's, `titanlab.ledger.planner_costs`), None the FLOP model's."""
    from titanlab.config.manager import build_config
    from titanlab.planning import planner
    from titanlab.planning.cluster import get_profile

    config = build_config(rest)
    model_args = planner.model_args_of(config)
    if opts.calibrate:
        cluster = calibrated(config, model_args, opts.nproc, opts.calibrate)
    else:
        cluster = get_profile(opts.cluster).with_nodes(opts.nodes)
    global_batch, how = planner.global_batch_of(config, cluster.world_size)
    run = planner.run_of(config, cluster.device_type, global_batch)
    ledger = priced is not None and cluster.device_type != "cpu"
    print(  # the ledger's steps take a minute or more on a CPU: say what is under way
        f"plan: ranking the layouts of {config.model.name} {config.model.flavor} on "
        f"{cluster.nodes} × {cluster.devices_per_node} {cluster.name}"
        + (
            " (compute priced by the per-op ledger: steps recorded on fake tensors, a minute "
            "or more on a CPU; --compute flops is faster) ..."
            if ledger
            else " ..."
        ),
        file=sys.stderr,
        flush=True,
    )
    costs = None
    if ledger:
        assert priced is not None
        costs = priced(rest, opts.cluster)
    ranked = planner.plan(config, model_args, cluster, run, costs=costs)
    print(
        f"{config.model.name} {config.model.flavor} on {cluster.nodes} × {cluster.devices_per_node} "
        f"{cluster.name} ({cluster.world_size} devices, {cluster.memory_bytes / GIB:.0f} GiB "
        f"each): seq_len {run.seq_len}, global batch {run.global_batch}{how}, {run.dtype}; "
        + ("compute priced by the per-op ledger" if costs else "compute by the FLOP model")
    )
    print(table([c for c in ranked if c.fits][: opts.top]))
    refused = [c for c in ranked if not c.fits]
    if refused:
        print(f"\n{len(refused)} layouts do not run; for example:")
        for c in refused[: min(5, len(refused))]:
            print(f"  {c.layout.name}: {c.refused}")
    chosen = ranked[0]
    if opts.explain:
        match = [c for c in ranked if c.layout.name == opts.explain]
        if not match:
            raise ConfigError(
                f"--explain {opts.explain}: not a candidate layout of {cluster.world_size} "
                f"devices; candidates are named like {ranked[0].layout.name}"
            )
        chosen = match[0]
        print("\n" + explain(chosen))
    if opts.apply:
        from titanlab.config.dump import to_toml

        if not chosen.fits:
            raise ConfigError(f"--apply: {chosen.layout.name} does not run: {chosen.refused}")
        assert chosen.config is not None  # set for every layout the validator accepts
        with open(opts.apply, "w", encoding="utf-8") as f:
            f.write(to_toml(chosen.config))
        print(f"\nwrote {chosen.layout.name} to {opts.apply} (./run_train.sh {opts.apply})")
    return 0


def calibrated(config, model_args, nproc: int, path: str):
    """Measure this machine for `nproc` ranks (`titanlab.planning.calibrate`), write the profile
    to `path` and print what was measured."""
    from titanlab.planning.calibrate import calibrate
    from titanlab.planning.cluster import save_profile

    if nproc < 1:
        raise ConfigError(f"--nproc={nproc}: a profile needs at least 1 rank per node")
    cluster = calibrate(config, model_args, nproc)
    save_profile(cluster, path)
    e = cluster.efficiency
    print(
        f"calibrated {cluster.name} for {nproc} ranks: matmul {max(cluster.peak_flops.values()) / 1e9:.1f} "
        f"GFLOP/s per rank ({', '.join(cluster.peak_flops)}), attention {e.attention:.2f} of "
        f"it, pointwise {e.pointwise:.2f} of the GEMM time, optimizer "
        f"{cluster.memory_bandwidth / 1e9:.1f} GB/s, link α {cluster.intra_latency * 1e6:.0f} µs "
        f"β {cluster.intra_bandwidth / 1e9:.2f} GB/s, split backward "
        f"{cluster.split_backward_s * 1e3:.2f} ms per block, TP {cluster.tp_block_s * 1e3:.1f} ms "
        f"per block, FSDP {cluster.fsdp_gather_s * 1e3:.2f} ms per all-gather and "
        f"{cluster.fsdp_reduce_s * 1e3:.2f} ms per reduce-scatter; written to {path}"
    )
    return cluster


_CALIBRATE = (
    "python -m titanlab.plan --calibrate PROFILE.json, then TITANLAB_CLUSTER_PROFILE=PROFILE.json"
)


def preflight_summary(config, plan, world_size: int) -> str:
    """The pre-flight's line for a config that passes: its layout, the memory estimate (the
    check just made) and the planner's prediction on this machine's profile, when there is one
    (`cluster.profile_of_this_machine`). Without one, a GPU machine's line says how to make
    one; a CPU machine's says nothing (a debug log): asking for a prediction is setting
    $TITANLAB_CLUSTER_PROFILE."""
    from titanlab.planning.cluster import profile_of_this_machine
    from titanlab.planning.perf_model import ModelShape, predict
    from titanlab.planning.planner import layout_of, run_of

    lay = layout_of(config, world_size, plan.batch.grad_accum_steps)
    m = plan.memory
    line = f"pre-flight: {lay.name} passes; memory {m.total / GIB:.2f} GiB per rank ({m.summary()})"
    cluster = profile_of_this_machine()
    if cluster is None:
        import torch

        if not torch.cuda.is_available():  # a CPU machine: no prediction unless asked for one
            logger.debug("pre-flight: no profile to predict the step with (%s)", _CALIBRATE)
            return line
        return line + f"; no profile of this GPU to predict the step with ({_CALIBRATE})"
    run = run_of(config, cluster.device_type, plan.batch.global_batch_size)
    p = predict(ModelShape.of(plan.model_args), run, lay, cluster)
    return line + (
        f"; predicted on {cluster.name}: {p.step_s * 1e3:,.1f} ms a step, "
        f"{p.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {p.mfu:.1%}"
    )


def table(cands: list[Candidate]) -> str:
    """The ranked layouts that run as a Markdown table: step in milliseconds, tokens/s per device,
    MFU (of the bf16 peak), memory per device in GiB (the pre-flight's estimate), exposed
    communication in milliseconds, the pipeline bubble as a fraction of compute."""
    rows = [
        "| # | layout | ZeRO | AC | grad accum | step ms | tokens/s/device | MFU | memory GiB "
        "| exposed comm ms | bubble |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, c in enumerate(cands, 1):
        p, m = c.prediction, c.memory
        assert p is not None and m is not None
        zero = c.layout.zero_stage if c.layout.dp_shard * c.layout.cp > 1 else "-"
        rows.append(
            f"| {i} | {c.layout.name} | {zero} | {c.ac_mode} | {c.layout.grad_accum} | "
            f"{p.step_s * 1e3:,.1f} | "
            f"{p.tokens_per_s_per_device:,.0f} | {p.mfu:.1%} | {m.total / GIB:.1f} | "
            f"{p.exposed_comm_s * 1e3:,.1f} | {p.bubble:.1%} |"
        )
    return "\n".join(rows)


def explain(c: Candidate) -> str:
    """The arithmetic of one layout: compute, bubble, optimizer, each collective, memory."""
    p, m = c.prediction, c.memory
    if p is None or m is None:
        return f"{c.layout.name}: {c.refused}"
    measured = [(name, s) for name, s in (("split backward", p.split_backward_s),
                ("TP overhead", p.tp_overhead_s), ("FSDP overhead", p.fsdp_overhead_s)) if s]  # fmt: skip
    lines = [
        f"{c.layout.name}: step {p.step_s:.4f} s = compute {p.compute_s:.4f} + bubble "
        f"{p.bubble_s:.4f} ({p.bubble:.1%} of compute) + optimizer {p.optimizer_s:.4f} + "
        + "".join(f"{name} {s:.4f} + " for name, s in measured)
        + f"exposed communication {p.exposed_comm_s:.4f}",
        f"AC {c.ac_mode}, {c.layout.grad_accum} accumulation step(s); MFU {p.mfu:.1%}, "
        f"{p.tokens_per_s_per_device:,.0f} tokens/s per device",
        "| collective | mesh dim | group | link | bytes per step | calls | seconds | exposed s |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for t in p.comm:
        link = "intra-node" if t.intra_node else "inter-node"
        lines.append(
            f"| {t.kind} | {t.dim} | {t.group} | {link} | {t.bytes / GIB:.3f} GiB | {t.calls} | "
            f"{t.seconds:.4f} | {t.exposed:.4f} |"
        )
    lines.append(f"memory per device: {m.total / GIB:.2f} GiB ({m.summary()})")
    if c.refused:
        lines.append(f"does not run: {c.refused}")
    return "\n".join(lines)
