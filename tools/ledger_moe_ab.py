"""titanlab's Mixture-of-Experts step against torchtitan 0.2.2's, as the per-op ledger prices
them for an H100: both stacks' steps recorded under the same fake tensors, as rank 0 of 8 GPUs
(FSDP 8, expert parallel 8), at the published flavors' dims, seq_len 4096, local batch 1.

    python tools/ledger_moe_ab.py [--only qwen3_moe] [--layers N] [--write]

Each row runs both stacks with the same options where both have them (eager or compiled,
full or per-op selective activation checkpointing); the last row of each model is titanlab's
fastest option set ("pieces": the MoE layer compiled around FSDP's hooks with a capacity of
1.25 in 2 chunks, which torchtitan has no option for) beside torchtitan's fastest row. MFU is
the model's FLOPs (titanlab's count, the same work on both sides) over the step at the H100's
dense bf16 peak. torchtitan's step is `tools/lib/torchtitan_moe_ledger.py` (its own models,
parallelize functions, optimizers and loss). `--write` puts the table in docs/performance.md
(block `ledger-moe-ab`). Needs torchtitan (the dev extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import write_block
from tools.lib.torchtitan_moe_ledger import MoEShape, step_builder

RANKS = EP = 8
COMPILE = ["--compile.enable", "true", "--compile.components", "model,loss"]
TT_COMPILE = ["--compile.enable", "--compile.components", "model,loss"]  # torchtitan's flag
FULL_AC = ["--activation_checkpoint.mode", "full"]
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]  # fmt: skip
PIECES = [*COMPILE, *FULL_AC, "--parallelism.expert_capacity_factor", "1.25",
          "--parallelism.expert_dispatch_chunks", "2"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    family: str
    flavor: str
    titanlab_args: tuple[str, ...]  # the config and options that give the flavor on 8 ranks
    # torchtitan's flavor made titanlab's shape where they differ: (field, value) of its model
    # args and of its MoEArgs
    changes: tuple[tuple[str, object], ...] = ()
    moe_changes: tuple[tuple[str, object], ...] = ()

    def shape(self, layers: int | None) -> MoEShape:
        return MoEShape(self.family, self.flavor, layers, changes=self.changes,
                        moe_changes=self.moe_changes)  # fmt: skip


MODELS = (
    Model("Qwen3-30B-A3B", "qwen3_moe", "30B-A3B",
          ("--job.config_file", "train_configs/qwen3_30b_a3b.toml")),
    Model("DeepSeek-V3 16B", "deepseek_v3", "16B",
          ("--job.config_file", "train_configs/deepseek_v3_671b.toml", "--model.flavor", "16B",
           "--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "1"),
          # titanlab's 16B is Moonlight's shape (DeepSeek-V3's architecture); torchtitan's has
          # DeepSeek-V2-Lite's vocabulary, dense FFN and softmax routing
          changes=(("vocab_size", 163840), ("inter_dim", 11264)),
          moe_changes=(("score_func", "sigmoid"), ("route_norm", True), ("route_scale", 2.446))),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    titanlab: tuple[str, ...]
    torchtitan: tuple[str, ...] | None  # None: torchtitan's fastest row of the model

    @property
    def same_options(self) -> bool:
        return self.torchtitan is not None


ROWS = (
    Row("eager · full AC", tuple(FULL_AC), tuple(FULL_AC)),
    Row("compiled · full AC", (*COMPILE, *FULL_AC), (*TT_COMPILE, *FULL_AC)),
    Row("compiled · per-op selective AC", (*COMPILE, *OP_SAC), (*TT_COMPILE, *OP_SAC)),
    Row("titanlab pieces · torchtitan's fastest", tuple(PIECES), None),
)


def titanlab_ledger(model: Model, options: tuple[str, ...], layers: int | None):
    from titanlab.ledger.run import build_ledger

    depth = ["--model.n_layers", str(layers)] if layers else []
    argv = [*model.titanlab_args, "--comm.fake_world_size", str(RANKS),
            "--parallelism.expert_parallel_degree", str(EP), *depth, *options]  # fmt: skip
    return build_ledger([os.path.join(REPO, a) if a.endswith(".toml") else a for a in argv], "h100")


def torchtitan_step_s(model: Model, options: tuple[str, ...], layers: int | None) -> float:
    """torchtitan's step (seconds) as rank 0 of a fake world of `RANKS`."""
    from titanlab.distributed.init import destroy_distributed, init_fake_world
    from titanlab.ledger.loop import ledger_of_loop

    shape = model.shape(layers)
    init_fake_world(RANKS, "cpu")
    try:
        build = step_builder(shape, list(options), dp_shard=RANKS, ep=EP)
        led = ledger_of_loop(build, "h100", shape.seq_len, 0.0, "torchtitan", shape.seq_len)
        return led.priced.step_s
    finally:
        destroy_distributed(barrier=False)


def measure(model: Model, layers: int | None) -> list[tuple[str, float, float, float]]:
    """(row, titanlab s, torchtitan s, the step's model FLOPs in seconds at the H100's dense
    bf16 peak) for every row of `model`."""
    out, theirs_by_row = [], {}
    for row in ROWS:
        ours = titanlab_ledger(model, row.titanlab, layers)
        if row.same_options:
            theirs = theirs_by_row[row.name] = torchtitan_step_s(model, row.torchtitan, layers)
        else:
            theirs = min(theirs_by_row.values())
        out.append((row.name, ours.priced.step_s, theirs,
                    ours.model_flops / ours.device.flops("bfloat16")))  # fmt: skip
        print(f"{model.name} · {row.name}: titanlab {ours.priced.step_s * 1e3:.1f} ms, "
              f"torchtitan {theirs * 1e3:.1f} ms", flush=True)  # fmt: skip
    return out


def table(results: dict[str, list[tuple[str, float, float, float]]]) -> str:
    lines = ["| model | row | titanlab ms | MFU | torchtitan ms | MFU | titanlab speed-up |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, rows in results.items():
        for row, ours, theirs, ideal in rows:
            lines.append(f"| {name} | {row} | {ours * 1e3:.1f} | {100 * ideal / ours:.1f}% "
                         f"| {theirs * 1e3:.1f} | {100 * ideal / theirs:.1f}% "
                         f"| {theirs / ours:.2f}× |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=[m.family for m in MODELS],
                   default=[m.family for m in MODELS])  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the flavor's)")
    p.add_argument("--write", action="store_true", help="write the table to docs/performance.md")
    opts = p.parse_args(argv)
    start = time.time()
    results = {m.name: measure(m, opts.layers) for m in MODELS if m.family in opts.only}
    text = table(results)
    print(text)
    if opts.write:
        head = (f"`python tools/ledger_moe_ab.py --write` ({time.time() - start:.0f} s on this "
                "CPU): both stacks' MoE steps priced for the H100 by the per-op ledger, rank 0 of "
                "8 GPUs (FSDP 8, EP 8), the flavors' own depth, seq_len 4096, local batch 1.\n\n")  # fmt: skip
        write_block(os.path.join(REPO, "docs", "performance.md"), "ledger-moe-ab", head + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
