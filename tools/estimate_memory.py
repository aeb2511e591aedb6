"""Estimate per-rank memory of a training config before launching it.

    python tools/estimate_memory.py --nproc 8 --job.config_file train_configs/llama_8b.toml [--section.key V ...]

Prints the per-rank bytes by category (parameters, gradients, optimizer state, gathered
parameters, activations for the chosen AC mode traced on fake tensors, logits and loss, the
block recomputed under AC, runtime overhead), the predicted peak, and the verdict against this
machine's memory (GPU memory, or host memory shared by the local processes).
The same estimate is the trainer's pre-flight check (`titanlab.planning.memory`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlab.components import builders as components
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.distributed.parallelize import param_dtype
from titanlab.planning.memory import GIB, available_bytes_per_rank, estimate_memory
from titanlab.planning.memory_estimate import CATEGORIES

import torch


def main(argv: list[str]) -> int:
    nproc = 1
    if argv[:1] == ["--nproc"]:
        nproc, argv = int(argv[1]), argv[2:]
    try:
        config = build_config(argv)
        tokenizer = components.build_tokenizer(config)
        args = components.build_model_args(config, tokenizer.vocab_size)
    except ConfigError as e:
        print(f"estimate_memory: error: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    est = estimate_memory(args, config, nproc, param_dtype(config, device))
    have, what = available_bytes_per_rank(nproc)
    print(
        f"{config.model.name} {config.model.flavor}, seq_len {config.training.seq_len}, local batch "
        f"{config.training.local_batch_size}, AC {config.activation_checkpoint.mode}, {nproc} rank(s)"
    )
    print(f"{'category':<18}{'GiB per rank':>14}")
    for name in (*CATEGORIES, "recompute"):
        print(f"{name:<18}{getattr(est, name) / GIB:>14.2f}")
    print(f"{'total (peak)':<18}{est.total / GIB:>14.2f}")
    when = (
        "the optimizer step"
        if est.grads >= est.activations + max(est.logits, est.recompute)
        else "the start of backward"
    )
    print(
        f"peak at {when}"
        + (
            " (gradient accumulation keeps gradients alive through forward)"
            if est.grads_during_forward
            else ""
        )
    )
    verdict = "fits" if est.total <= have else "does NOT fit"
    print(f"available: {what} → {verdict}")
    return 0 if est.total <= have else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
