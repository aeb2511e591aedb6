"""The ledger against the GPU rows measured so far: predicted and measured step time of every
titanlab row of docs/performance.md, with the error.

    python tools/ledger_calibration.py [--write]

Each row is `titanlab ledger` (`titanlab.ledger.run.build_ledger`, priced by
`titanlab.ledger.price`) of a run measured on a GPU, on the code that ran then:

- the trainer rows `tools/gpu_check.py` timed (train_configs/llama_8b.toml on Llama 3.1 8B's
  dims with 11 of 32 blocks, vocab 128,256, seq_len 8192, local batch 1, one GPU): the H100
  rows of 2026-11-23 before the fused loss existed (`--loss.fused_linear_cross_entropy
  false`), the FA2 row among them with cuDNN's SDPA off (`cudnn_sdp`), and the H200 rows of
  the torchtitan A/B of 2026-11-27 with the fused loss as it ran then (`before_2026_11_28`:
  the head's weight cast in every chunk, its gradient summed chunk by chunk as fp32 GEMMs);
- the plain PyTorch loop of the same H200 run (`tools/lib/plain_loop.py`, block `cuda-8b`),
  recorded by `titanlab.ledger.loop.ledger_of_loop`;
- the LoRA and QLoRA rows of `tools/benchmark_finetune.py` on the H200 (`FINETUNE`), the fused
  loss as it ran then; its Liger row is listed, not predicted (Liger's Triton kernels are
  priced as PyTorch ops, docs/ledger.md "Limits").

Every row has RoPE in real pairs, as it ran eagerly until 2026-11-30 (`real_pair_rope`;
compiled, it still does). The rows marked fit derive `LedgerEfficiency`'s factors from their
profiled kernel times (`fit`, each row the factors its `fits` names); the others check them.
`tools/ledger_ab.py` predicts the A/B with the code as it is now. `--write` puts the table in
docs/performance.md (block `ledger-calibration`). Units: seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from titanlab.ledger.price import dtype_key
import torch

from tools.lib.bench import write_block
from tools.lib.ledger_replays import (
    before_2026_11_28,
    cudnn_sdp,
    nf4_base,
    nf4_on_cpu,
    real_pair_rope,
)
from tools.lib.llama_blocks import LAYERS, model_args

PLAIN_LOSS = ("--loss.fused_linear_cross_entropy", "false")
FUSED_LOSS = ("--loss.fused_linear_cross_entropy", "true")
FLOAT8_TW = ("--float8.enable", "true", "--float8.recipe_name", "tensorwise")
FLOAT8_RW = ("--float8.enable", "true", "--float8.recipe_name", "rowwise")
SELECTIVE = ("--activation_checkpoint.mode", "selective")
EAGER = ("--compile.enable", "false")
NF4 = ("--peft.quantize_base", "nf4")

FINETUNE = {"hidden": 2048, "layers": 8, "vocab": 128256, "seq": 8192, "rank": 16, "lr": 1e-4}
"""The H200 fine-tuning rows' model and run (docs/performance.md, "H200, 2026-11-27: titanlab
LoRA/QLoRA against transformers + peft"; `tools/benchmark_finetune.py --seq 8192 --hidden 2048
--layers 8 --vocab 128256`): a Llama of hidden 2048, 8 layers, head dim 64 (32 heads, as many KV
heads), the debug flavor's FFN rule, untied head; LoRA rank 16 (alpha 32) on wq and wv, AdamW
lr 1e-4, clipping at 1.0, batch 1 of 8,192 tokens."""

LIGER = "Liger's Triton kernels are priced as PyTorch's unfused ops (docs/ledger.md, Limits)"


@dataclasses.dataclass(frozen=True)
class Row:
    """A measured GPU row: its name, device profile, measured step seconds, where it is
    recorded (docs/performance.md's section), the ledger's options, the code then, and which
    efficiencies it fits."""

    name: str
    device: str
    measured_s: float
    source: str
    args: tuple[str, ...] = ()
    """Options of `titanlab.train` (trainer and finetune rows) beyond the run's own."""
    run: str = "trainer"
    """What ran: "trainer" (`tools/gpu_check.py`'s and the torchtitan A/B's titanlab rows:
    train_configs/llama_8b.toml on Llama 3.1 8B's dims with `LAYERS` blocks), "finetune"
    (`tools/benchmark_finetune.py`'s titanlab rows, `FINETUNE`) or "plain" (the plain loop,
    `tools/lib/plain_loop.py`, as `tools/benchmark.py --gpu-8b` runs it, options `plain`)."""
    fp32_head_grad: bool = False
    """The fused loss as it ran until 2026-11-28 (`before_2026_11_28`, chunks of 256 tokens):
    the H200 rows of 2026-11-27 with the fused loss on (under LoRA the head is frozen, so only
    its per-chunk weight cast applies)."""
    cudnn_sdp: bool = True
    """Whether SDPA's cuDNN backend was enabled (off: `torch.backends.cuda.enable_cudnn_sdp
    (False)`, FlashAttention-2 runs)."""
    profile_ms: tuple[tuple[str, float], ...] = ()
    """GPU ms of the row's profiled step by kernel kind (docs/performance.md, `gpu-check`)."""
    fits: tuple[str, ...] = ()
    """The `LedgerEfficiency` factors `fit` derives from this row's `profile_ms` (empty: a
    check row)."""
    plain: tuple[tuple[str, object], ...] = ()
    """A plain-loop row's `plain_loop.build` spec beyond `plain_spec`'s: precision, compile."""
    not_predicted: str = ""
    """Why the ledger cannot predict this row (listed, not priced)."""


ROWS = (
    Row("bf16 · compile · AC none", "h100", 0.333, "H100 2026-11-23", PLAIN_LOSS,
        profile_ms=(("attention", 42), ("gemm", 189), ("optimizer", 53), ("fused", 32)),
        fits=("memory", "fused", "attention")),
    Row("float8 tensorwise · compile · AC none", "h100", 0.304, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW, profile_ms=(("gemm", 162),), fits=("float8_tensorwise",)),
    Row("float8 rowwise · compile · AC none", "h100", 0.337, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_RW, profile_ms=(("gemm", 190),), fits=("float8_rowwise",)),
    # the follow-up run's FA2 row: cuDNN's SDPA off, torch's FlashAttention-2 (attention 80 ms)
    Row("bf16 · compile · AC none · FA2 (cuDNN SDPA off)", "h100", 0.363,
        "H100 2026-11-23 (follow-up run)", PLAIN_LOSS, cudnn_sdp=False,
        profile_ms=(("attention", 80), ("gemm", 185), ("optimizer", 53), ("fused", 32)),
        fits=("attention_flash",)),
    Row("bf16 · compile · AC selective", "h100", 0.366, "H100 2026-11-23", PLAIN_LOSS + SELECTIVE),
    Row("float8 tensorwise · compile · AC selective", "h100", 0.301, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW + SELECTIVE),
    Row("bf16 · eager · AC none", "h100", 0.395, "H100 2026-11-23 (follow-up run)",
        PLAIN_LOSS + EAGER),
    # the H200 rows of the torchtitan A/B: 8,192 tokens over titanlab's tokens/s
    Row("bf16 · compile · AC none (fused loss, fp32 head gradient)", "h200", 8192 / 14954,
        "H200 2026-11-27", (), fp32_head_grad=True),
    Row("float8 tensorwise · compile · AC none (fused loss, fp32 head gradient)", "h200",
        8192 / 16219, "H200 2026-11-27", FLOAT8_TW, fp32_head_grad=True),
    Row("bf16 · compile · AC selective (fused loss, fp32 head gradient)", "h200", 8192 / 14198,
        "H200 2026-11-27", SELECTIVE, fp32_head_grad=True),
    # the same run's plain loop (block `cuda-8b`: median step ms)
    Row("plain loop · bf16 · eager · AC none", "h200", 0.3660, "H200 2026-11-27 (`cuda-8b`)",
        run="plain", plain=(("precision", "bf16"), ("compile", False))),
    Row("plain loop · bf16 · compile · AC none", "h200", 0.3185, "H200 2026-11-27 (`cuda-8b`)",
        run="plain", plain=(("precision", "bf16"), ("compile", True))),
    Row("plain loop · float8 tensorwise · compile · AC none", "h200", 0.2727,
        "H200 2026-11-27 (`cuda-8b`)", run="plain",
        plain=(("precision", "float8"), ("compile", True))),
    # LoRA/QLoRA fine-tuning (block `finetune-cuda`), eager (debug_model.toml)
    Row("LoRA · fused loss", "h200", 0.092, "H200 2026-11-27 (LoRA/QLoRA)", FUSED_LOSS,
        run="finetune", fp32_head_grad=True),
    Row("LoRA · plain loss", "h200", 0.083, "H200 2026-11-27 (LoRA/QLoRA)", PLAIN_LOSS,
        run="finetune"),
    Row("QLoRA (NF4) · fused loss", "h200", 0.096, "H200 2026-11-27 (LoRA/QLoRA)",
        FUSED_LOSS + NF4, run="finetune", fp32_head_grad=True),
    Row("LoRA · fused loss · Liger", "h200", 0.075, "H200 2026-11-27 (LoRA/QLoRA)",
        FUSED_LOSS + ("--kernels.liger", "true"), run="finetune", not_predicted=LIGER),
)  # fmt: skip


def finetune_args(folder: str) -> list[str]:
    """`titanlab.train`'s options for `tools/benchmark_finetune.py`'s titanlab rows (`FINETUNE`:
    its `build_hf` model as an HF config.json written in `folder`, no rope scaling, as its
    `LlamaConfig` has none; its `titanlab_row` options on one process, no checkpoint)."""
    from titanlab.models.registry import get_family

    f = FINETUNE
    family = get_family("llama3")
    heads = f["hidden"] // 64
    args = dataclasses.replace(
        family.flavors["debugmodel"], dim=f["hidden"], n_layers=f["layers"], n_heads=heads,
        n_kv_heads=heads, vocab_size=f["vocab"], max_seq_len=f["seq"], rope_scaling=None,
    )  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as out:
        json.dump(family.hf.to_config(args, torch.float32, f["seq"], None, None), out)
    return [
        "--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--model.flavor", "hf", "--model.hf_config", folder, "--comm.fake_world_size", "1",
        "--checkpoint.enable", "false", "--validation.enable", "false",
        "--training.seq_len", str(f["seq"]), "--training.local_batch_size", "1",
        "--training.global_batch_size", "1", "--training.max_norm", "1.0",
        "--optimizer.name", "AdamW", "--optimizer.lr", str(f["lr"]),
        "--lr_scheduler.warmup_steps", "0", "--peft.method", "lora",
        "--peft.rank", str(f["rank"]), "--peft.alpha", str(2 * f["rank"]),
        "--peft.target_modules", "wq,wv", "--kernels.liger", "false",
    ]  # fmt: skip


def plain_spec(row: Row) -> dict:
    """`plain_loop.build`'s spec of a plain-loop row: `tools/benchmark.py --gpu-8b
    --gpu-layers 11` (Llama 3 8B's dims with `LAYERS` blocks, vocab 128,256, seq 8192, batch
    1), with the row's precision and compile."""
    spec = {"model": "llama3", "flavor": "8B", "layers": LAYERS, "vocab": 128256, "seq": 8192}
    return {**spec, **dict(row.plain)}


def predict(row: Row, folder: str):
    """The ledger (`titanlab.ledger.run.Ledger`) of `row` on its device, on the code it ran:
    RoPE in real pairs, the fused loss of 2026-11-27 where `fp32_head_grad`, cuDNN's SDPA as
    `cudnn_sdp` says."""
    if row.run == "plain":
        return predict_plain(row)
    from titanlab.ledger.run import build_ledger

    if row.run == "finetune":
        argv = finetune_args(os.path.join(folder, "finetune"))
        if "--peft.quantize_base" in row.args:
            argv += [
                "--checkpoint.initial_load_path",
                nf4_base(os.path.join(folder, "base"), FINETUNE["hidden"], FINETUNE["layers"]),
            ]
    else:
        config = os.path.join(REPO, "train_configs", "llama_8b.toml")
        argv = ["--job.config_file", config, "--comm.fake_world_size", "1",
                *model_args(folder), "--activation_checkpoint.mode", "none"]  # fmt: skip
    then = ("--loss.chunk_size", "256") if row.fp32_head_grad else ()  # the default then
    nf4 = "--peft.quantize_base" in row.args
    with (
        before_2026_11_28(row.fp32_head_grad),
        real_pair_rope(),
        cudnn_sdp(row.cudnn_sdp),
        nf4_on_cpu(nf4),
    ):
        return build_ledger([*argv, *row.args, *then], row.device)


def predict_plain(row: Row):
    """The plain loop's ledger (`ledger_of_loop`, as
    `tests/unit/ledger/test_trainer_overhead.py::plain_ledger` records it) at `plain_spec`,
    with RoPE in real pairs as it ran on 2026-11-27."""
    from titanlab.ledger.loop import ledger_of_loop
    from tools.lib import plain_loop

    spec = plain_spec(row)

    def build():
        loop = plain_loop.build(spec, torch.device("cpu"), init_weights=False)
        tokens = torch.zeros(1, spec["seq"] + 1, dtype=torch.long)
        return lambda: loop.step(tokens)

    with real_pair_rope(), cudnn_sdp(row.cudnn_sdp):
        return ledger_of_loop(build, row.device, spec["seq"], 0.0, "the plain loop", spec["seq"])


def kernel_kind(op) -> str:
    """The profile's kernel kind of a recorded op (docs/performance.md's `gpu-check` tables):
    attention, gemm, optimizer (AdamW and the gradient norm's kernels), fused (a compiled
    region's Triton kernels) or other."""
    from titanlab.ledger.price import _fuses

    if op.kind in ("attention", "gemm"):
        return op.kind
    if op.phase in ("optimizer", "grad_norm"):
        return "optimizer"
    return "fused" if _fuses(op) else "other"


FACTORS = ("memory", "fused", "attention", "attention_flash", "float8_tensorwise",
           "float8_rowwise")  # fmt: skip
"""The `LedgerEfficiency` factors a row can fit (`Row.fits`)."""


def fit(recorded: dict[Row, list]) -> dict[str, float]:
    """The efficiencies the fit rows imply, each factor from the rows whose `fits` name it: a
    kind's recorded work (bytes or FLOPs) over its measured GPU time (`profile_ms`) at the
    device's peak. memory: the optimizer kernels' bytes at HBM bandwidth; fused: the compiled
    regions' traffic (`fused_traffic`) at HBM bandwidth; attention (cuDNN) and attention_flash
    (FlashAttention-2): the attention FLOPs at the bf16 peak; float8 tensorwise and rowwise:
    the float8 GEMMs' FLOPs at the float8 peak over the GEMM time less the other GEMMs' (the
    bf16 output head) at the profile's matmul efficiency."""
    from titanlab.ledger.price import fused_traffic
    from titanlab.planning.cluster import get_profile

    out: dict[str, float] = {}
    for row, ops in recorded.items():
        unknown = set(row.fits) - set(FACTORS)
        if unknown:
            raise ValueError(f"{row.name}: no such factor to fit: {sorted(unknown)}")
        if not row.fits:
            continue
        device, ms = get_profile(row.device), dict(row.profile_ms)
        work: dict[str, float] = {}
        float8 = other_gemm_s = 0.0
        for op, (read, written) in zip(ops, fused_traffic(ops)):
            if op.kind in ("view", "collective"):
                continue
            kind = kernel_kind(op)
            work[kind] = work.get(kind, 0.0) + (op.flops if op.flops else read + written)
            if kind == "gemm" and op.dtype.startswith("float8"):
                float8 += op.flops
            elif kind == "gemm":
                other_gemm_s += op.flops / (
                    device.flops(dtype_key(op.dtype)) * device.efficiency.matmul
                )
        bandwidth = device.memory_bandwidth
        for name in row.fits:
            if name == "memory":
                out[name] = work["optimizer"] / (ms["optimizer"] / 1e3 * bandwidth)
            elif name == "fused":
                out[name] = work["fused"] / (ms["fused"] / 1e3 * bandwidth)
            elif name in ("attention", "attention_flash"):
                peak = device.flops("bfloat16")
                out[name] = work["attention"] / (ms["attention"] / 1e3 * peak)
            else:  # float8_tensorwise, float8_rowwise
                gemm_s = ms["gemm"] / 1e3 - other_gemm_s
                out[name] = float8 / (gemm_s * device.flops("float8"))
    return out


def used_for(row: Row) -> str:
    """What `row` is used for in the table: "fit: <factors>", "check" or "not predicted"."""
    if row.not_predicted:
        return "not predicted"
    return "fit: " + ", ".join(row.fits) if row.fits else "check"


def summary(results: list[tuple[Row, float | None]]) -> list[str]:
    """Max and mean |error| of the fit rows (in sample) and of the check rows (out of sample),
    one line each."""
    lines = []
    for label, fitted in (("In sample (fit rows)", True), ("Out of sample (check rows)", False)):
        errors = [abs(predicted / row.measured_s - 1) for row, predicted in results
                  if predicted is not None and bool(row.fits) == fitted]  # fmt: skip
        if not errors:
            lines.append(f"{label}: none.")
            continue
        lines.append(f"{label}, {len(errors)}: max |error| {100 * max(errors):.1f}%, mean "
                     f"|error| {100 * sum(errors) / len(errors):.1f}%.")  # fmt: skip
    return lines


def table(results: list[tuple[Row, float | None]]) -> str:
    """The markdown table of (row, predicted step seconds or None for a row not predicted),
    then `summary`'s lines."""
    lines = [
        "| row | measured on | used to | measured s | predicted s | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row, predicted in results:
        head = f"| {row.name} | {row.source} | {used_for(row)} | {row.measured_s:.3f} |"
        if predicted is None:
            lines.append(f"{head} - | {row.not_predicted} |")
            continue
        error = predicted / row.measured_s - 1
        lines.append(f"{head} {predicted:.3f} | {100 * error:+.1f}% |")
    return "\n".join([*lines, "", *summary(results)])


def main(argv: list[str] | None = None) -> int:
    from titanlab.ledger.price import LedgerEfficiency, price
    from titanlab.planning.cluster import get_profile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the table to docs/performance.md")
    opts = p.parse_args(argv)
    start = time.time()
    recorded = {}
    with tempfile.TemporaryDirectory() as folder:
        os.makedirs(os.path.join(folder, "finetune"))
        for row in ROWS:
            if row.not_predicted:
                continue
            recorded[row] = predict(row, folder).ops
            print(f"recorded {row.name} ({row.source})", flush=True)
    fitted = fit(recorded)
    shipped = LedgerEfficiency()
    factors = "; ".join(f"{k} {v:.3f} (shipped {getattr(shipped, k):.2f})"
                        for k, v in fitted.items())  # fmt: skip
    print(f"fitted: {factors}")
    results = [
        (row, price(recorded[row], get_profile(row.device)).step_s if row in recorded else None)
        for row in ROWS
    ]
    text = table(results)
    print(text)
    if opts.write:
        f = FINETUNE
        head = (f"`python tools/ledger_calibration.py --write` ({time.time() - start:.0f} s on "
                "this CPU): the ledger's step against the measured one, one GPU. The trainer "
                f"and plain-loop rows: Llama 3.1 8B dims with {LAYERS} blocks, vocab 128,256, "
                "seq_len 8192, local batch 1 (the plain loop: `tools/lib/plain_loop.py`, as "
                "`tools/benchmark.py --gpu-8b` ran it). The LoRA rows: `tools/benchmark_finetune"
                f".py`'s Llama of hidden {f['hidden']}, {f['layers']} layers, vocab 128,256, "
                f"seq_len {f['seq']}, LoRA rank {f['rank']} on q/v, eager. Fitted on the rows "
                f"marked fit, each on the factors named (their profiled kernel times): "
                f"{factors}; `LedgerEfficiency` ships them rounded. Errors in sample (fit rows) "
                "and out of sample (check rows) below the table; the Liger row is listed, not "
                "predicted.\n\n")  # fmt: skip
        write_block(os.path.join(REPO, "docs", "performance.md"), "ledger-calibration",
                    head + text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
