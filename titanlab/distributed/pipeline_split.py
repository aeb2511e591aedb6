"""Pipeline stages balanced by cost: where each stage begins and ends when the split is by
parameter count or by FLOPs rather than by layer count (`parallelism.pipeline_parallel_split`).

The model is a chain of units: the embedding, each transformer block, and the final norm +
output projection (with any multi-token prediction depths, which run after it). A stage is a contiguous run of blocks, the first stage also holding the
embedding and the last the norm + output. `balanced_counts` picks the blocks per stage that make
the costliest stage as cheap as possible (the linear-partition problem, solved exactly by
dynamic programming over the block boundaries); every stage keeps at least one block.

Costs per unit (`unit_costs`):
- params: the unit's parameter count (the embedding's full table included): what a stage
  holds in weights, gradients and optimizer state;
- flops: training FLOPs per token of the unit (forward + backward): 6 × its matmul parameters
  (Kaplan et al. 2020; an MoE block's experts counted at top_k / num_experts, the ones a token
  runs) plus a block's attention, `attention_flops_per_token` (12 × heads × head_dim × seq_len
  for GQA; PaLM, Chowdhery et al. 2022, App. B), as
  `titanlab.models.common.counting.flops_per_token` counts the whole model; the
  embedding is a lookup (0), the final norm + output projection 6 × (dim + vocab × dim). With a large vocabulary the
  output is worth many blocks, so the last stage gets fewer of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torch import nn

from titanlab.config.job_config import ConfigError
from titanlab.models.common.counting import attention_flops_per_token
from titanlab.models.common.mtp import trains_mtp

SPLITS = ("layers", "params", "flops")


@dataclass(frozen=True)
class UnitCosts:
    """Per-unit costs of one measure: the embedding, each block in order, the norm + output."""

    embedding: int
    blocks: tuple[int, ...]
    head: int

    def stage_costs(self, counts: list[int]) -> list[int]:
        """Cost of each stage holding `counts` blocks (the ends with embedding and head)."""
        out, start = [], 0
        for i, n in enumerate(counts):
            cost = sum(self.blocks[start : start + n])
            cost += self.embedding if i == 0 else 0
            cost += self.head if i == len(counts) - 1 else 0
            out.append(cost)
            start += n
        return out


def _params(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _block_matmul_params(block: nn.Module) -> int:
    """Parameters a token multiplies by in `block`: routed experts at top_k / num_experts."""
    from titanlab.models.common.decoder import moe_layers

    n = _params(block)
    for moe in moe_layers(block):
        experts = _params(moe.experts)
        n -= experts - experts * moe.args.top_k // moe.args.num_experts
    return n


def unit_costs(model: nn.Module, args, seq_len: int, by: str) -> UnitCosts:
    """Costs of `model`'s units by `by` ("params" or "flops"; see the module docstring).
    `model` may be on the meta device; `args` its DecoderArgs."""
    blocks = list(cast(nn.ModuleDict, model.layers).values())
    embedding = getattr(model, "tok_embeddings", None)
    head = [getattr(model, "norm", None), getattr(model, "output", None)]
    depths = getattr(model, "mtp", None)
    mtp = list(depths.values()) if depths is not None else []
    if by == "params":
        return UnitCosts(
            _params(embedding),
            tuple(_params(b) for b in blocks),
            sum(map(_params, head)) + sum(map(_params, mtp)),
        )
    if by != "flops":
        raise ValueError(f"unit costs by {by!r}; valid: params, flops")
    attention = attention_flops_per_token(args, seq_len)
    # trained MTP depths: each its block, its eh_proj and norms, and the output head once more
    trained = mtp if trains_mtp(args) else []
    output = _params(getattr(model, "output", None))
    depth_flops = sum(6 * (_block_matmul_params(d) + output) + attention for d in trained)
    return UnitCosts(
        0,
        tuple(6 * _block_matmul_params(b) + attention for b in blocks),
        6 * sum(map(_params, head)) + depth_flops,
    )


def balanced_counts(costs: UnitCosts, n_stages: int) -> list[int]:
    """Blocks per stage (each >= 1, in order) minimizing the costliest stage's cost; among equal
    optima the one found first by the recursion below (earlier stages take more blocks).

    Raises ConfigError when there are fewer blocks than stages."""
    n = len(costs.blocks)
    if n_stages > n:
        raise ConfigError(
            f"{n_stages} pipeline stages need at least as many layers; the model has {n}"
        )
    prefix = [0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> int:
        c = prefix[end] - prefix[start]
        c += costs.embedding if stage == 0 else 0
        return c + (costs.head if stage == n_stages - 1 else 0)

    # best[k][j]: the least max cost of stages k.. over blocks j.., and the first stage's end.
    inf = float("inf")
    best = [[(inf, -1)] * (n + 1) for _ in range(n_stages + 1)]
    best[n_stages][n] = (0, n)
    for k in range(n_stages - 1, -1, -1):
        left = n_stages - k - 1  # stages after this one, each needing a block
        for j in range(n - left - 1, -1, -1):
            for end in range(n - left, j, -1):  # more blocks first: ties keep the larger
                rest = best[k + 1][end][0]
                value = max(cost(k, j, end), rest)
                if value < best[k][j][0]:
                    best[k][j] = (value, end)
    counts, j = [], 0
    for k in range(n_stages):
        end = best[k][j][1]
        counts.append(end - j)
        j = end
    return counts


def describe(
    fqns: list[list[str]], costs: dict[str, UnitCosts], by: str, counts: list[int], even: list[int]
) -> str:
    """The start-up summary of a split: per stage its modules, parameters (and the bytes of fp32
    weights, gradients and two AdamW moments before data-parallel sharding) and FLOPs share, and
    the costliest stage's share against the layer split's."""

    def short(names: list[str]) -> str:
        blocks = [n for n in names if n.startswith("layers.")]
        rest = [n for n in names if not n.startswith("layers.")]
        span = f"{blocks[0]}-{blocks[-1].split('.')[1]}" if len(blocks) > 1 else " ".join(blocks)
        return " ".join(filter(None, [*(r for r in rest if r == "tok_embeddings"), span,
                                      *(r for r in rest if r != "tok_embeddings")]))  # fmt: skip

    flops, params = costs["flops"].stage_costs(counts), costs["params"].stage_costs(counts)
    even_flops = costs["flops"].stage_costs(even)
    total = sum(flops)
    parts = [
        f"stage {i} {short(names)}: {params[i] / 1e6:.2f}M params "
        f"({params[i] * 16 / 2**20:.1f} MiB of weights, gradients and AdamW state in fp32), "
        f"{flops[i] / total:.0%} of the FLOPs"
        for i, names in enumerate(fqns)
    ]
    return (
        f"pipeline: {len(fqns)} stages split by {by}; the costliest stage does "
        f"{max(flops) / total:.0%} of the FLOPs (split by layers: {max(even_flops) / total:.0%}); "
        + "; ".join(parts)
    )
