"""Decode rows of the benchmark: generation tokens/s of the debug model, batch 1 and 8, eager and
compiled.

    python tools/benchmark_decode.py [--new-tokens 64] [--prompt-len 32] [--repeats 3]
                                     [--checkpoint CKPT] [--out docs/performance.md]

Each row runs `titanlab.generation.generate` (greedy, KV cache) on the Llama 3 debug model
(random weights, or `--checkpoint`'s) in one process with one intra-op thread per core of the
machine, fp32 (CUDA: bf16): a batch of prompts of `--prompt-len` tokens continued by
`--new-tokens` tokens each. tokens/s = new tokens of the batch ÷ the wall time of the whole call
(prefill included), the median of `--repeats` calls after one warm-up call. Compiled rows wrap
the model in `torch.compile(dynamic=True)` (one graph for every cache length); the warm-up call
pays the compilation. The table replaces the `<!-- benchmark:decode:begin/end -->` block of
`--out`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools.lib import bench

ROWS = [(1, False), (8, False), (1, True), (8, True)]  # (batch, compiled)


def build(checkpoint: str, device, dtype):
    import torch

    from titanlab.generation.loading import load_model
    from titanlab.models.llama3 import llama3_flavors
    from titanlab.models.registry import build_model

    if checkpoint:
        return load_model(checkpoint, device, dtype)[0]
    torch.manual_seed(0)
    model = build_model(llama3_flavors["debugmodel"])
    model.init_weights()
    return model.to(device=device, dtype=dtype).eval()


def time_row(model, batch: int, compiled: bool, prompt_len: int, new: int, repeats: int) -> dict:
    import torch

    from titanlab.generation import generate

    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    run = torch.compile(model, dynamic=True) if compiled else model
    begin = time.perf_counter()
    generate(run, prompts, new)  # warm-up (and compilation)
    warm = time.perf_counter() - begin
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        out = generate(run, prompts, new)
        times.append(time.perf_counter() - begin)
        assert all(len(o) == new for o in out)
    median = statistics.median(times)
    return {"batch": batch, "compiled": compiled, "tps": batch * new / median,
            "ms_per_token": 1000 * median / new, "warmup_s": warm}  # fmt: skip


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| batch | compile | new tokens/s | ms per decode step | first call (s) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['batch']} | {'yes' if r['compiled'] else 'no'} | {r['tps']:,.1f} | "
            f"{r['ms_per_token']:.1f} | {r['warmup_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint", default="")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    a = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(a.checkpoint, device, dtype)
    rows = []
    for batch, compiled in ROWS:
        rows.append(time_row(model, batch, compiled, a.prompt_len, a.new_tokens, a.repeats))
        print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name() if cuda else ""
    command = "python tools/benchmark_decode.py " + shlex.join(argv)
    header = (
        f"Machine: {bench.cpu_model()}, {os.cpu_count()} cores, {bench.ram_gib():.0f} GiB RAM"
        f"{', GPU ' + gpu if gpu else ''}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, {str(dtype).split('.')[-1]}; "
        f"prompt {a.prompt_len} tokens, {a.new_tokens} new tokens per sequence, greedy.\n"
        f"Command: `{command.strip()}`"
    )
    body = table(rows, header)
    print(body)
    bench.write_block(a.out, "decode", body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
