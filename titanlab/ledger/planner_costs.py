"""The planner's compute costs priced by the per-op ledger (`titanlab.planning.compute_costs`):
the job's model with two or three of its blocks (`model.n_layers`), one sequence per rank under
FSDP and the layout's expert parallel (its collectives left to the planner's communication
model), recorded and priced like `titanlab ledger`, once per activation-checkpointing mode and
expert-parallel degree."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from titanlab.ledger.record import fsdp_copy
from titanlab.ledger.run import Ledger, build_ledger
from titanlab.planning.compute_costs import ComputeCosts

MIN_RANKS = 2
"""Ranks of the priced run at least: the planner's layouts shard the model (FSDP's bf16
parameters, where one device alone would train under autocast)."""


def ranks(ep: int) -> int:
    """Ranks of the run priced for expert-parallel degree `ep`: FSDP over all of them, ep of
    them holding the experts (each its E/ep experts and the tokens the balanced all-to-all
    brings), as a layout with that ep runs its blocks."""
    return max(MIN_RANKS, ep)


def fsdp_run(ep: int = 1) -> list[str]:
    """The job under FSDP (and expert parallel `ep`) alone, one sequence per rank and step:
    what the planner scales. The planner checks each layout's memory; these ranks need not
    hold a big model's blocks."""
    n = str(ranks(ep))
    return [
        "--comm.fake_world_size", n, "--training.local_batch_size", "1",
        "--training.global_batch_size", "-1", "--parallelism.data_parallel_replicate_degree", "1",
        "--parallelism.data_parallel_shard_degree", n, "--parallelism.tensor_parallel_degree", "1",
        "--parallelism.context_parallel_degree", "1", "--parallelism.pipeline_parallel_degree", "1",
        "--parallelism.expert_parallel_degree", str(ep), "--training.memory_check", "false",
    ]  # fmt: skip


UPDATE_PHASES = ("grad_norm", "optimizer", "step")
"""The ledger's phases after the backward: the update, priced per parameter."""


def ac_options(ac_mode: str) -> list[str]:
    """The trainer's options of the planner's AC mode name (none, full, selective_op,
    selective_<k>); ValueError for another."""
    if ac_mode in ("none", "full"):
        return ["--activation_checkpoint.mode", ac_mode]
    option = ac_mode.removeprefix("selective_")
    if ac_mode.startswith("selective_") and (option == "op" or option.isdigit()):
        return ["--activation_checkpoint.mode", "selective",
                "--activation_checkpoint.selective_ac_option", option]  # fmt: skip
    raise ValueError(f"ac_mode={ac_mode!r}: use none, full, selective_op or selective_<k>")


def costs_of(
    ledger: Ledger,
    n_layers: int,
    dense_first: int,
    params: int,
    world: int = MIN_RANKS,
    kinds: list | None = None,
) -> ComputeCosts:
    """`ComputeCosts` of a ledger of a model shortened to `ledger`'s blocks, FSDP's copies
    apart (priced per byte its all-gathers and reduce-scatters move): its first block
    stands for the model's `dense_first` leading dense blocks (DeepSeek-V3's; 0: none), the
    mean of the others for the rest of its `n_layers`; `params` is the shortened model's
    parameter count (the update's cost is per parameter). With `kinds` (each of the model's
    blocks' kind, `token_mixer.block_kinds`; the shortened model's blocks are its first ones),
    each kind's mean cost in the ledger weighs by its share of the model's blocks (Qwen3.5:
    three linear-attention layers per full one)."""  # fmt: skip
    blocks: dict[int, float] = defaultdict(float)
    head = embedding = update = copies = moved = 0.0
    for op, s in zip(ledger.ops, ledger.priced.seconds):
        if op.kind == "collective":
            if op.collective in ("all_gather", "reduce_scatter"):
                moved += op.bytes_read  # the gathered buffer, the reduce-scatter's input
            continue
        parts = op.module.split(".")
        if fsdp_copy(op.op, op.phase):
            copies += s
        elif op.phase in UPDATE_PHASES:
            update += s
        elif parts[0] == "layers" and len(parts) > 1:
            blocks[int(parts[1])] += s
        elif parts[0] == "tok_embeddings":
            embedding += s
        else:  # the final norm, the output head, the loss, MTP depths
            head += s
    costs = [blocks[i] for i in sorted(blocks)]
    if kinds is not None and not dense_first:
        by_kind: dict = defaultdict(list)
        for i, cost in zip(sorted(blocks), costs, strict=True):
            by_kind[kinds[i]].append(cost)
        block = sum(sum(by_kind[k]) / len(by_kind[k]) for k in kinds) / len(kinds)
    elif dense_first and len(costs) > 1:
        rest = sum(costs[1:]) / (len(costs) - 1)
        block = (dense_first * costs[0] + (n_layers - dense_first) * rest) / n_layers
    else:
        block = sum(costs) / len(costs)
    per_rank = params / world  # FSDP's (and EP's) shard of every parameter
    per_byte = copies / moved if moved else 0.0
    return ComputeCosts(
        block, head, embedding, update / per_rank, fsdp_copy_s_per_byte=per_byte,
        source=ledger.config_summary,
    )  # fmt: skip


def ledger_costs(argv: list[str], device: str) -> Callable[[str, int], ComputeCosts]:
    """The compute costs of the job `argv` (a `titanlab.train` command line) on `device` (a
    cluster profile name or file) by AC mode and expert-parallel degree, each ledger built on
    first use. Raises ConfigError (one line) as `build_ledger`."""
    from titanlab.config.manager import build_config
    from titanlab.models.common.shortened import shortened
    from titanlab.planning.model_shape import ModelShape
    from titanlab.planning.planner import model_args_of

    from titanlab.models.common.token_mixer import block_kinds

    args = model_args_of(build_config([*argv, "--comm.mode", "fake_backend"]))
    dense_first = getattr(args, "n_dense_layers", 0)
    kinds = block_kinds(args)
    # enough blocks for every kind the model has (Qwen3.5: its first full-attention layer)
    every_kind = 1 + max(kinds.index(k) for k in set(kinds))
    n = min(args.n_layers, max(3 if dense_first else 2, every_kind))
    params = ModelShape.of(shortened(args, n)).total_params
    found: dict[tuple[str, int], ComputeCosts] = {}

    def costs(ac_mode: str, ep: int = 1) -> ComputeCosts:
        if (ac_mode, ep) not in found:
            run = [*argv, *fsdp_run(ep), "--model.n_layers", str(n), *ac_options(ac_mode)]
            ledger = build_ledger(run, device)
            found[ac_mode, ep] = costs_of(
                ledger, args.n_layers, dense_first, params, ranks(ep), kinds
            )
        return found[ac_mode, ep]

    return costs
