"""LoRA fine-tuning: titanlab against transformers + peft on the same model and work, side by side.

    python tools/benchmark_finetune.py [--seq 512,2048] [--hidden 512] [--layers 8]
        [--vocab 32768,131072] [--rank 16] [--steps 3] [--warmup 1] [--threads 2] [--budget-gib 16]
        [--liger] [--out docs/performance.md]

For each vocabulary size of `--vocab`, one Hugging Face `LlamaForCausalLM` (hidden `--hidden`,
`--layers` layers, head dim 64, untied head; random weights, seed 0) is saved locally and imported into titanlab with
`convert_checkpoint from-hf`. Every row trains LoRA adapters of rank `--rank` (alpha 2 × rank,
no dropout) on the attention query and value projections (titanlab `wq, wv`; peft `q_proj,
v_proj`), AdamW lr 1e-4, gradient clipping at 1.0, batch 1 of `--seq` tokens, in one process:
on CPU in fp32 with `--threads` intra-op threads, on a CUDA GPU in bf16 (titanlab's default
mixed precision; peft's model loaded in bf16 under autocast):

- titanlab: the real trainer (`python -m titanlab.train`, `model.flavor = "hf"`,
  `checkpoint.initial_load_path` the import), with the fused linear cross-entropy (its
  default chunks of 256 tokens) and without;
  tokens from the bundled corpus; step time from its per-step tokens/s (log_freq 1);
- transformers + peft: `get_peft_model` on the same folder (SDPA attention), a plain loop of
  forward with labels, backward, clip, step; random token ids below 4096 (the same range).
- `--liger` (CUDA, liger-kernel installed): also titanlab with `kernels.liger` and the fused
  loss, and transformers + peft after Liger's `apply_liger_kernel_to_llama` (a second peer).

Step time: median over `--steps` steps after `--warmup`. Memory: on CPU the peak resident set
of the whole process (`ru_maxrss`; every byte the step allocates lands there), on CUDA
`max_memory_allocated` (titanlab's `mem_peak_allocated_gib`). Longest sequence
within `--budget-gib`: from a straight line through each row's measured peaks (memory grows
linearly with the sequence at these lengths; attention through SDPA keeps no seq² tensor), so it
is an extrapolation, marked as such. peft and transformers are benchmark-only dependencies
(`pip install 'titanlab[bench]' peft`); titanlab never imports them. The table replaces the
`<!-- benchmark:finetune:begin/end -->` block of `--out` (`finetune-cuda` on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools.lib import bench
from tools.lib.runs import failure_line

TAG = "finetune"
LR = 1e-4


def build_hf(out: str, vocab: int, a: argparse.Namespace) -> None:
    """The shared model of vocabulary `vocab` as a Hugging Face folder (random weights, seed 0)."""
    import dataclasses

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from titanlab.models.llama3 import llama3_flavors

    heads = a.hidden // 64
    args = dataclasses.replace(
        llama3_flavors["debugmodel"], dim=a.hidden, n_layers=a.layers, n_heads=heads,
        n_kv_heads=heads, vocab_size=vocab, max_seq_len=max(a.seqs),
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim(),
        num_hidden_layers=args.n_layers, num_attention_heads=heads, num_key_value_heads=heads,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


def titanlab_row(
    dcp: str, data: str, seq: int, vocab: int, fused: bool, a: argparse.Namespace,
    liger: bool = False, qlora: bool = False,
) -> dict:  # fmt: skip
    name = "titanlab QLoRA (NF4)" if qlora else "titanlab LoRA"
    name += " · fused loss" if fused else " · plain loss"
    name += " · Liger" if liger else ""
    row = {"name": name, "seq": seq, "vocab": vocab}
    with tempfile.TemporaryDirectory(prefix="titanlab_ft_") as dump:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "titanlab.train", "--job.config_file", bench.CONFIG, "--model.flavor", "hf",
            "--checkpoint.initial_load_path", dcp, "--checkpoint.enable", "false",
            "--job.dump_folder", dump, "--data.dataset_path", data,
            "--training.steps", str(a.warmup + a.steps), "--training.seq_len", str(seq),
            "--training.local_batch_size", "1", "--training.global_batch_size", "1",
            "--training.max_norm", "1.0", "--optimizer.name", "AdamW", "--optimizer.lr",
            str(LR), "--lr_scheduler.warmup_steps", "0", "--validation.enable", "false",
            "--metrics.log_freq", "1", "--peft.method", "lora", "--peft.rank", str(a.rank),
            "--peft.alpha", str(2 * a.rank), "--peft.target_modules", "wq,wv",
            "--loss.fused_linear_cross_entropy", str(fused).lower(),
            "--kernels.liger", str(liger).lower(),
            *(["--peft.quantize_base", "nf4"] if qlora else []),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        path = os.path.join(dump, "metrics.jsonl")
        if proc.returncode or not os.path.exists(path):
            return dict(row, error=failure_line(proc.stdout + proc.stderr))
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    times = bench.step_times(records, seq, a.warmup)
    key = "mem_peak_allocated_gib" if a.cuda else "memory_gib"  # as peft's row measures
    peak = max(r[key] for r in records)
    return dict(row, step_s=statistics.median(times), peak_gib=peak)


def peft_child(hf: str, seq: int, a: argparse.Namespace) -> None:
    """In a child process: the transformers + peft loop; prints its row as JSON."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.set_num_threads(a.threads)
    if a.liger:  # Liger's patches of transformers' Llama (RMSNorm, SwiGLU, RoPE, fused loss)
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    device = torch.device("cuda" if a.cuda else "cpu")
    dtype = torch.bfloat16 if a.cuda else torch.float32
    model = LlamaForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"])  # fmt: skip
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, 4096, (1, seq), generator=gen).to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=a.cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # waits for the device
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if a.cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    print(json.dumps({"step_s": statistics.median(times), "peak_gib": peak}))


def peft_row(hf: str, seq: int, vocab: int, a: argparse.Namespace, liger: bool = False) -> dict:
    row = {"name": "transformers + peft" + (" + Liger" if liger else ""), "seq": seq,
           "vocab": vocab}  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--peft-child", "--hf", hf, "--seq",
           str(seq), "--rank", str(a.rank), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads)] + (["--liger"] if liger else [])  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        return dict(row, error=failure_line(proc.stderr))
    return dict(row, **json.loads(proc.stdout.strip().splitlines()[-1]))


def longest(rows: list[dict], name: str, vocab: int, budget: float) -> str:
    """The sequence length at which a straight line through `name`'s measured peaks at `vocab`
    reaches `budget` GiB (an extrapolation), as text."""
    points = [(r["seq"], r["peak_gib"]) for r in rows
              if r["name"] == name and r["vocab"] == vocab and "error" not in r]  # fmt: skip
    if len(points) < 2:
        return "n/a"
    (s0, m0), (s1, m1) = points[0], points[-1]
    slope = (m1 - m0) / (s1 - s0)
    if slope <= 0:
        return "n/a"
    return f"~{int(s0 + (budget - m0) / slope):,}"


def render(rows: list[dict], a: argparse.Namespace, command: str) -> str:
    import torch

    from titanlab.observability.hostinfo import cpu_model, ram_gib

    where = (
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}, bf16"
        if a.cuda
        else f"{cpu_model()}, {os.cpu_count()} cores, {ram_gib():.0f} GiB RAM; torch "
        f"{torch.__version__}, fp32, {a.threads} threads"
    )
    memory = "peak allocated GiB" if a.cuda else "peak RSS GiB"
    lines = [
        f"Machine: {where}, 1 process. Llama of hidden "
        f"{a.hidden}, {a.layers} layers; LoRA rank {a.rank} on q/v, AdamW; "
        f"batch 1; median of {a.steps} steps after {a.warmup} (method: "
        "`tools/benchmark_finetune.py`).",
        f"Command: `{command}`",
        "",
        f"| run | vocab | seq_len | s / step | vs peft | {memory} | vs peft |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peer = next((p for p in rows if p["name"] == "transformers + peft" and p["seq"] == r["seq"]
                     and p["vocab"] == r["vocab"] and "error" not in p), None)  # fmt: skip
        head = f"| {r['name']} | {r['vocab']:,} | {r['seq']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | |")
            continue
        speed = f"{peer['step_s'] / r['step_s']:.2f}×" if peer else "n/a"
        memory = f"{r['peak_gib'] / peer['peak_gib']:.2f}×" if peer else "n/a"
        lines.append(f"{head} {r['step_s']:.3f} | {speed} | {r['peak_gib']:.2f} | {memory} |")
    names = list(dict.fromkeys(r["name"] for r in rows))
    lines += ["", f"Longest sequence within {a.budget_gib:g} GiB (extrapolated from the peaks "
              "above):"]  # fmt: skip
    for vocab in a.vocabs:
        fits = ", ".join(f"{n} {longest(rows, n, vocab, a.budget_gib)}" for n in names)
        lines.append(f"- vocab {vocab:,}: {fits} tokens.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="512,2048", help="comma-separated sequence lengths")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", default="32768,131072", help="comma-separated vocabulary sizes")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--liger", action="store_true",
                   help="CUDA: also rows with Liger's kernels (titanlab kernels.liger; peft + "
                   "apply_liger_kernel_to_llama); needs liger-kernel")  # fmt: skip
    p.add_argument("--qlora", action="store_true",
                   help="also titanlab QLoRA (NF4 base through torchao; peft's QLoRA needs "
                   "bitsandbytes, not a dependency here)")  # fmt: skip
    p.add_argument("--peft-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.seqs = [int(s) for s in a.seq.split(",")]
    import torch

    a.cuda = torch.cuda.is_available()
    if a.liger and not a.cuda and not a.peft_child:
        raise SystemExit("error: --liger needs a CUDA GPU (Liger's kernels are Triton)")
    a.vocabs = [int(v) for v in a.vocab.split(",")]
    if a.peft_child:
        return peft_child(a.hf, a.seqs[0], a)
    command = ("python tools/benchmark_finetune.py " + shlex.join(sys.argv[1:])).strip()
    with tempfile.TemporaryDirectory(prefix="titanlab_ft_") as work:
        data = os.path.join(work, "data")
        prepare_corpus(data, max(a.seqs) * (a.warmup + a.steps + 1))
        rows = []
        for vocab in a.vocabs:
            hf, dcp = (os.path.join(work, f"{n}-{vocab}") for n in ("hf", "dcp"))
            build_hf(hf, vocab, a)
            convert = [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                       "from-hf", hf, dcp, "--quiet"]  # fmt: skip
            subprocess.run(convert, cwd=REPO, check=True, capture_output=True)
            for seq in a.seqs:
                ours = functools.partial(titanlab_row, dcp, data, seq, vocab, a=a)
                peer = functools.partial(peft_row, hf, seq, vocab, a)
                runs = [functools.partial(ours, True), peer, functools.partial(ours, False)]
                if a.liger:
                    runs += [functools.partial(ours, True, liger=True),
                             functools.partial(peer, liger=True)]  # fmt: skip
                if a.qlora:
                    runs += [functools.partial(ours, True, qlora=True)]
                for run in runs:  # the table after every row: a run cut off keeps the rows
                    rows.append(run())
                    print(json.dumps(rows[-1]), flush=True)
                    bench.write_block(a.out, TAG + ("-cuda" if a.cuda else ""),
                                      render(rows, a, command))  # fmt: skip
    print(render(rows, a, command))


def prepare_corpus(out: str, tokens: int) -> None:
    """The bundled corpus tokenized with the bundled tokenizer (ids < 4096), at least `tokens`
    tokens."""
    from titanlab.data.default_corpus import default_corpus_files
    from titanlab.data.prepare import prepare_data
    from titanlab.data.tokenizer import default_tokenizer_path

    files, size = [], 0
    for path in default_corpus_files():  # ~3 bytes per token: take twice what is needed
        files.append(path)
        size += os.path.getsize(path)
        if size >= 6 * tokens:
            break
    meta = prepare_data(files, out, default_tokenizer_path(), workers=1, progress=False)
    if meta["total_tokens"] < tokens:
        raise SystemExit(f"the corpus gave {meta['total_tokens']} tokens; {tokens} needed")


if __name__ == "__main__":
    main()
