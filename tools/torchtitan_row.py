"""One torchtitan benchmark row: torchtitan's own `Trainer` in this process, timed as
`tools/gpu_bench_row.py` times titanlab's, for `tools/benchmark_torchtitan.py`'s A/B.

    PYTHONPATH=<torchtitan 0.2.2 and its needs> python tools/torchtitan_row.py --out ROW.json
        [--layers 4] [--dim 4096 --heads 32 --kv-heads 8 --ffn-multiplier 1.3 --multiple-of 1024]
        [--vocab 128256] [--warmup 3] [--cpu] -- TORCHTITAN_ARGS...

A peer, for benchmarks only: titanlab never imports torchtitan. The model is torchtitan's own
Llama 3 (`torchtitan.models.llama3`) with the shape asked for, registered as train spec
`titanlab_ab`, flavor `ab`; its batches are uniform random token ids (the step's work does not
depend on them), so neither a tokenizer nor a dataset is read. TORCHTITAN_ARGS are torchtitan's
own command-line flags (`--training.seq_len 8192 --compile.enable ...`). Written to `--out`:
each step's seconds (`Trainer.train_step`, then `torch.cuda.synchronize`), the median after
`--warmup` steps, tokens/s, torchtitan's own FLOPs per token,
`torch.cuda.max_memory_allocated` / `max_memory_reserved` (bytes) since the first step's log,
and the peak resident set size (bytes). An out-of-memory error is written as {"error": ...}.

`--cpu` runs it on this machine's CPU: torchtitan 0.2.2 knows CUDA, ROCm and XPU devices only,
so a stand-in device module (`CpuDevice`) answers its few device calls; used for the CPU check
of this script and for a CPU comparison row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.torchtitan_cpu import use_cpu

SPEC, FLAVOR = "titanlab_ab", "ab"


class RandomTokens:
    """torchtitan's data loader protocol (iterable of ({"input": ids}, labels), stateful):
    (local_batch, seq_len) int64 ids uniform in [0, vocab), the labels the ids shifted by
    one; a fixed seed, so every run sees the same batches."""

    def __init__(self, local_batch: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.shape, self.vocab, self.seed = (local_batch, seq_len + 1), vocab, seed

    def __iter__(self):
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        while True:
            ids = torch.randint(0, self.vocab, self.shape, generator=gen)
            yield {"input": ids[:, :-1]}, ids[:, 1:]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def register(args: argparse.Namespace) -> None:
    """Train spec `titanlab_ab`: torchtitan's llama3 spec with one flavor of the asked shape,
    random tokens for data, no tokenizer and no validator."""
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import register_train_spec

    shape = llama3.TransformerModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        ffn_dim_multiplier=args.ffn_multiplier,
        multiple_of=args.multiple_of,
        rope_theta=500000,
    )

    def loader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        t = job_config.training
        return RandomTokens(t.local_batch_size, t.seq_len, args.vocab, seed=dp_rank)

    spec = dataclasses.replace(
        llama3.get_train_spec(),
        model_args={FLAVOR: shape},
        build_dataloader_fn=loader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
    )
    register_train_spec(SPEC, spec)


def run(args: argparse.Namespace, titan_args: list[str]) -> dict:
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    config = ConfigManager().parse_args(
        ["--model.name", SPEC, "--model.flavor", FLAVOR, *titan_args]
    )
    cuda = not args.cpu
    step_s: list[float] = []

    class TimedTrainer(Trainer):
        def train_step(self, data_iterator):  # type: ignore[override]
            start = time.perf_counter()
            super().train_step(data_iterator)
            if cuda:
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - start)

    trainer = TimedTrainer(config)
    try:
        trainer.train()
        flops = int(trainer.metrics_processor.num_flops_per_token)
        params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    timed = step_s[args.warmup :]
    median = statistics.median(timed)
    tokens = config.training.local_batch_size * config.training.seq_len
    return {
        "step_s": [round(t, 4) for t in step_s],
        "median_step_s": round(median, 4),
        "tps": round(tokens / median, 1),
        "flops_per_token_torchtitan": flops,
        "params": params,
        "max_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torchtitan": _version(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "unknown"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where the row's JSON goes")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn-multiplier", type=float, default=1.3)
    p.add_argument("--multiple-of", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (a stand-in device)")
    return p.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: list[str] | None = None) -> int:
    args, titan_args = parse(sys.argv[1:] if argv is None else argv)
    from tools.lib.gpu_rows import single_rank_env, write_row

    single_rank_env()
    if args.cpu:
        use_cpu()
    register(args)
    return write_row(args.out, lambda: run(args, titan_args))


if __name__ == "__main__":
    sys.exit(main())
