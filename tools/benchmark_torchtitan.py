"""titanlab against torchtitan on the same work and the same device, interleaved.

    python tools/benchmark_torchtitan.py [--layers N] [--steps 10] [--warmup 4] [--repeats 1]
        [--rows A,B] [--cpu] [--out docs/torchtitan_ab.md] [--perf docs/performance.md]
        [--json FILE] [--budget-s 540]

Each row runs both stacks' own trainers, one process each, one after the other and in the
opposite order on the next repeat: titanlab's (`tools/gpu_bench_row.py`, the `llama_8b.toml`
job) and torchtitan's (`tools/torchtitan_row.py`, its `Trainer` with its `llama3` model), on
the same model shape (Llama 3 8B's blocks, `--layers` of them, vocab 128,256), seq_len 8192,
local batch 1, AdamW (lr 3e-4, eps 1e-8, weight decay 0.1), gradient clipping at 1.0, one GPU.
torchtitan's options are its `llama3_8b.toml`'s (float8 leaves `output` in bf16, as there);
each row sets the same compile, activation checkpointing (selective: per op, both) and float8
recipe in both. Each stack's median step after `--warmup` steps (≥ 5 timed steps), its
tokens/s, MFU (one FLOP count for both: titanlab's, against the device's dense bf16 peak) and
whole-run peak of `torch.cuda.max_memory_allocated`; the ratio is titanlab's tokens/s over
torchtitan's. The two models' parameter counts must agree, or the row fails.

torchtitan is a peer, benchmark-only: install it beside titanlab (`make peer-wheels` saves
torchtitan 0.2.2 and what it needs as wheels in `.whl/` for a machine without a network).
`--cpu` runs the same comparison on this machine's CPU, fp32, on a small shape (dim 512, 8
heads, 4 KV heads, 4 layers, vocab 32,000, seq_len 512, local batch 4): the check of this
script, and a CPU figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.ab_rows import CPU_ROWS, GPU_ROWS, Row

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and batch both stacks train: Llama 3 blocks of these dims."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_multiplier: float
    multiple_of: int
    vocab: int
    seq_len: int
    local_batch: int

    def job_args(self, steps: int) -> list[str]:
        """The flags both trainers name alike: steps, seq_len, local batch."""
        return [f"--training.steps={steps}", f"--training.seq_len={self.seq_len}",
                f"--training.local_batch_size={self.local_batch}"]  # fmt: skip

    def torchtitan_args(self) -> list[str]:
        return [
            f"--layers={self.layers}",
            f"--dim={self.dim}",
            f"--heads={self.heads}",
            f"--kv-heads={self.kv_heads}",
            f"--ffn-multiplier={self.ffn_multiplier}",
            f"--multiple-of={self.multiple_of}",
            f"--vocab={self.vocab}",
        ]

    def titanlab_config(self, folder: str) -> str:
        """A Hugging Face config.json of this shape for titanlab's `model.flavor = "hf"`."""
        import torch

        from titanlab.models.llama3 import llama3_flavors
        from titanlab.models.llama3.hf import to_config

        args = dataclasses.replace(
            llama3_flavors["8B"],
            dim=self.dim,
            n_layers=self.layers,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            ffn_dim_multiplier=self.ffn_multiplier,
            multiple_of=self.multiple_of,
            vocab_size=self.vocab,
        )
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(to_config(args, torch.bfloat16, self.seq_len, None, None), f, indent=1)
        return folder


def gpu_shape(layers: int) -> Shape:
    return Shape(4096, layers, 32, 8, 1.3, 1024, 128256, 8192, 1)


CPU_SHAPE = Shape(512, 4, 8, 4, 1.3, 256, 32000, 512, 4)


def titanlab_cmd(shape: Shape, row: Row, folder: str, out: str, a) -> list[str]:
    dump = os.path.join(os.path.dirname(out), "dump_titanlab")
    trainer = [
        "--job.config_file", os.path.join(REPO, "train_configs", "llama_8b.toml"),
        "--job.dump_folder", dump,
        "--model.flavor", "hf",
        "--model.hf_config", folder,
        *shape.job_args(a.steps),
        "--checkpoint.enable", "false",
        "--metrics.log_freq", "1",
    ]  # fmt: skip
    return [sys.executable, os.path.join(REPO, "tools", "gpu_bench_row.py"), "--out", out,
            "--warmup", str(a.warmup), "--", *trainer, *row.titanlab_args()]  # fmt: skip


def torchtitan_cmd(shape: Shape, row: Row, out: str, a) -> list[str]:
    dump = os.path.join(os.path.dirname(out), "dump_torchtitan")
    job = [
        "--job.dump_folder", dump,
        *shape.job_args(a.steps),
        "--training.max_norm", "1.0",
        "--optimizer.lr", "3e-4",
        "--optimizer.eps", "1e-8",
        "--lr_scheduler.warmup_steps", "200",
    ]  # fmt: skip
    cpu = ["--cpu"] if a.cpu else []
    return [sys.executable, os.path.join(REPO, "tools", "torchtitan_row.py"), "--out", out,
            "--warmup", str(a.warmup), *cpu, *shape.torchtitan_args(), "--", *job,
            *row.torchtitan_args()]  # fmt: skip


def run_child(cmd: list[str], out: str, timeout_s: int) -> dict:
    """The JSON a row script wrote, or {"error": ...} with its last lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, text = -1, f"timed out after {timeout_s} s"
    result: dict = {}
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    if code != 0 and "error" not in result:
        lines = [line for line in text.splitlines() if line.strip()]
        result = {"error": f"exit {code}: " + " | ".join(lines[-3:])[-400:]}
        print(text[-4000:], flush=True)
    result["wall_s"] = round(time.time() - start, 1)
    return result


def merge(runs: list[dict]) -> dict:
    """One stack's row over repeats: the median of the per-run medians, the peak's maximum."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    steps = [r["median_step_s"] for r in ok]
    out = dict(ok[0], median_step_s=statistics.median(steps), runs_s=steps)
    for key in ("max_allocated", "peak_rss"):
        values = [r[key] for r in ok if r.get(key)]
        out[key] = max(values) if values else None
    return out


def compare(shape: Shape, titan: dict, peer: dict) -> dict:
    """The row's figures: tokens/s, MFU and peak memory of both, titanlab's speed-up."""
    if "error" in titan or "error" in peer:
        return {"error": titan.get("error") or peer.get("error")}
    if titan["params"] != peer["params"]:
        return {"error": f"the models differ: {titan['params']:,} against {peer['params']:,} "
                         "parameters"}  # fmt: skip
    tokens = shape.seq_len * shape.local_batch
    tps = {k: tokens / r["median_step_s"] for k, r in (("titanlab", titan), ("torchtitan", peer))}
    flops, peak = titan.get("flops_per_token"), titan.get("peak_flops")
    memory = "max_allocated" if titan.get("max_allocated") else "peak_rss"
    return {
        "tps": tps,
        "mfu": {k: v * flops / peak for k, v in tps.items()} if flops and peak else None,
        "memory": {"titanlab": titan.get(memory), "torchtitan": peer.get(memory)},
        "memory_kind": memory,
        "ratio": tps["titanlab"] / tps["torchtitan"],
        "runs_s": {"titanlab": titan["runs_s"], "torchtitan": peer["runs_s"]},
        "titanlab_estimate_peak_tensors": titan.get("estimate_peak_tensors"),
    }


def render(rows: list[tuple[Row, dict]], shape: Shape, device: str, a) -> str:
    kind = next((r["memory_kind"] for _, r in rows if "memory_kind" in r), "max_allocated")
    mem = "peak RSS" if kind == "peak_rss" else "max_memory_allocated"
    lines = [
        f"Device: {device}; {datetime.date.today()}; torchtitan {a.torchtitan_version}. "
        f"Llama 3 shape: dim {shape.dim}, {shape.layers} layers, {shape.heads} heads "
        f"({shape.kv_heads} KV), vocab {shape.vocab:,}; seq_len {shape.seq_len}, local batch "
        f"{shape.local_batch}; median step of {a.steps - a.warmup} after {a.warmup}, "
        f"{a.repeats} interleaved repeat(s).",
        f"Command: `python tools/benchmark_torchtitan.py{' --cpu' if a.cpu else ''}"
        f"{f' --layers {a.layers}' if a.layers and not a.cpu else ''}"
        f"{f' --repeats {a.repeats}' if a.repeats != 1 else ''}`",
        "",
        f"| row | titanlab tokens/s | torchtitan tokens/s | titanlab / torchtitan | MFU "
        f"titanlab · torchtitan | {mem} titanlab · torchtitan (GiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row, r in rows:
        if "error" in r:
            lines.append(f"| {row.name} | {r['error'][:160].replace('|', '/')} | | | | |")
            continue
        mfu = (f"{r['mfu']['titanlab']:.1%} · {r['mfu']['torchtitan']:.1%}" if r["mfu"]
               else "—")  # fmt: skip
        memory = " · ".join(
            f"{r['memory'][k] / GIB:.2f}" if r["memory"][k] else "—"
            for k in ("titanlab", "torchtitan")
        )
        lines.append(
            f"| {row.name} | {r['tps']['titanlab']:,.0f} | {r['tps']['torchtitan']:,.0f} | "
            f"{r['ratio']:.3f}× | {mfu} | {memory} |"
        )
    return "\n".join(lines)


def publish(results: list[tuple[Row, dict]], shape: Shape, device: str, a) -> None:
    """The rows so far into `--out`, the perf block and `--json`."""
    table = render(results, shape, device, a)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("# titanlab against torchtitan\n\n" + table + "\n")
    from tools.lib.bench import write_block

    write_block(a.perf, "torchtitan-ab-cpu" if a.cpu else "torchtitan-ab", table)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"shape": dataclasses.asdict(shape),
                       "rows": [[r.name, d] for r, d in results]}, f, indent=1)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=0, help="8B blocks on the GPU (0: fit ~70%%)")
    p.add_argument("--steps", type=int, default=10, help="steps per run")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs of each stack")
    p.add_argument("--rows", default="", help="only rows whose name holds one of these (a,b)")
    p.add_argument("--cpu", action="store_true", help="on this CPU, fp32, the small shape")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "torchtitan_ab.md"))
    p.add_argument("--perf", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--json", default="", help="also write every figure here")
    p.add_argument("--budget-s", type=int, default=540, help="no run starts after this")
    p.add_argument("--timeout-s", type=int, default=420, help="one run's limit")
    a = p.parse_args(argv)
    if a.steps - a.warmup < 5:
        p.error(f"--steps {a.steps} with --warmup {a.warmup} times {a.steps - a.warmup} "
                "steps; at least 5 are needed")  # fmt: skip
    if importlib.util.find_spec("torchtitan") is None:
        print(
            "benchmark_torchtitan: torchtitan is not installed; install it beside titanlab "
            "(pip install torchtitan==0.2.2, or `make peer-wheels` for an offline machine)"
        )
        return 2
    from importlib.metadata import version

    import torch

    a.torchtitan_version = version("torchtitan")
    if a.cpu:
        from titanlab.observability.hostinfo import cpu_model

        shape, rows, device = CPU_SHAPE, CPU_ROWS, f"{cpu_model()}, {os.cpu_count()} cores"
    elif not torch.cuda.is_available():
        print(f"benchmark_torchtitan: torch {torch.__version__} sees no CUDA GPU; "
              "run it on a machine with one, or pass --cpu")  # fmt: skip
        return 2
    else:
        from tools.lib.gpu_rows import fit_layers

        memory = torch.cuda.get_device_properties(0).total_memory
        shape, rows = gpu_shape(a.layers or fit_layers(memory, 0.7)), GPU_ROWS
        device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    if a.rows:
        rows = tuple(r for r in rows if any(part in r.name for part in a.rows.split(",")))
    start, results = time.time(), []
    with tempfile.TemporaryDirectory() as tmp:
        folder = shape.titanlab_config(os.path.join(tmp, "model"))
        for k, row in enumerate(rows):
            runs: dict[str, list[dict]] = {"titanlab": [], "torchtitan": []}
            for rep in range(a.repeats):
                order = ("titanlab", "torchtitan") if (k + rep) % 2 == 0 else (
                    "torchtitan", "titanlab")  # fmt: skip
                for stack in order:
                    if time.time() - start > a.budget_s:
                        runs[stack].append({"error": f"not run: past the {a.budget_s} s budget"})
                        continue
                    out = os.path.join(tmp, f"row{k}_{rep}_{stack}", "row.json")
                    os.makedirs(os.path.dirname(out))
                    cmd = (titanlab_cmd(shape, row, folder, out, a) if stack == "titanlab"
                           else torchtitan_cmd(shape, row, out, a))  # fmt: skip
                    print(f"benchmark_torchtitan: {row.name} · {stack} · repeat {rep + 1}",
                          flush=True)  # fmt: skip
                    runs[stack].append(run_child(cmd, out, a.timeout_s))
            results.append((row, compare(shape, merge(runs["titanlab"]),
                                         merge(runs["torchtitan"]))))  # fmt: skip
            print(json.dumps(results[-1][1])[:600], flush=True)
            publish(results, shape, device, a)  # after every row: a cut-off run keeps these
    print(render(results, shape, device, a))
    return 1 if any("error" in d for _, d in results) else 0


if __name__ == "__main__":
    sys.exit(main())
