"""The pairwise ("all-pairs") covering of parallel layouts: `pairwise_subset` picks a small set
of layouts (`titanlab.planning.layouts`) in which every pair of features that can meet (PP ×
DDP, a schedule × HSDP, TP × gradient accumulation, ...) meets at least once, the way
pairwise testing covers a parameter space with few test cases. The parity matrices of CI
(`tools/parity_matrix.py`, the MoE and Muon layout tests) run such a subset.

Source: the greedy set cover (Chvátal, "A greedy heuristic for the set-covering problem",
1979), as used for pairwise test selection.
"""

from __future__ import annotations

import itertools

from titanlab.planning.layouts import Layout


def _family(feature: str) -> str:
    """The parallelism a feature belongs to: `pp:1F1B` and `pp4` are pp, `ep4` and `efsdp` ep."""
    if feature.startswith("pp"):
        return "pp"
    return "ep" if feature.startswith("e") and feature != "ep" else feature


LAUNCH_COST = 2
"""A launch's fixed cost (start-up, rendezvous, the reference's share), in ranks' worth."""


def pairwise_subset(layouts: list[Layout], must: tuple[frozenset[str], ...] = ()) -> list[Layout]:
    """A small subset of `layouts` in which every pair of features that meets in some layout
    meets at least once, and every tag set in `must` (see `Layout.tags`) is covered by one layout.

    Greedy set cover, cheapest first: each round takes the layout that covers the most uncovered
    pairs per unit of cost (ties: fewer ranks, then the input order), so the result is
    deterministic. A run's cost is its ranks plus `LAUNCH_COST`: on a 2-core CPU a 2-rank
    parity run takes ~7 s, a 4-rank one ~12 s and an 8-rank one ~22 s, so an 8-rank layout is
    worth it only where it covers more than twice what a 2-rank one does.

    A ZeRO variant (`Layout.variants`) changes only when the data-parallel ranks gather and
    reduce, so it must meet each parallelism (dp kind, tp, cp, pp, ep, grad_accum), not each
    pipeline schedule or degree; and the pairs of the other features must be met at FSDP2's
    default (stage 3, no offload), so a variant layout covers only its own pairs.
    """

    def pairs(lay: Layout) -> set[frozenset[str]]:
        feats = sorted(lay.features)
        if lay.variants:
            coarse = {_family(f) for f in feats if f not in lay.variants}
            own = sorted(lay.variants)
            return (
                {frozenset([v]) for v in own if v != "zero3"}
                | {frozenset(p) for p in itertools.combinations(own, 2)}
                | {frozenset((v, f)) for v in own if v != "zero3" for f in coarse}
            )
        single = {frozenset([f]) for f in feats}  # a feature alone counts too
        return single | {frozenset(p) for p in itertools.combinations(feats, 2)}

    chosen: list[Layout] = []
    for need in must:
        best = min(
            (lay for lay in layouts if need <= lay.tags),
            key=lambda lay: (lay.world_size, len(lay.features)),
            default=None,
        )
        if best is not None and best not in chosen:
            chosen.append(best)
    uncovered = set().union(*(pairs(lay) for lay in layouts)) if layouts else set()
    for lay in chosen:
        uncovered -= pairs(lay)
    while uncovered:
        best = max(
            layouts,
            key=lambda lay: (
                len(pairs(lay) & uncovered) / (lay.world_size + LAUNCH_COST),
                -lay.world_size,
            ),
        )
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen
