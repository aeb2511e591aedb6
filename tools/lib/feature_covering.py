"""Rows of the feature-pair matrix: the covering rows CI runs (every supported pair, and triple,
in at least one row, AETG), or a row per supported pair. `tools/feature_pairs.py` runs them;
`tools/lib/feature_matrix.py` defines the factors and levels, `feature_verdicts.py` judges them."""

from __future__ import annotations

import itertools

from tools.lib.feature_matrix import FACTORS, FIRST, Fixtures, Level, Row
from tools.lib.feature_verdicts import pair_row, verdict

CANDIDATE_SEEDS = 64
"""Candidate rows built per step of `covering_rows` (one per uncovered pair, in order)."""


def covering_rows(
    verdicts: dict[tuple[Level, Level], str | None],
    fixtures: Fixtures,
    helpers: dict[Level, Level | None],
    check_rows: bool = True,
    triples: dict[tuple[Level, Level, Level], str | None] | None = None,
) -> list[Row]:
    """Rows in which every supported pair (and every supported triple of `triples`) appears at
    least once, none holding a refused pair or triple (see the module docstring).

    AETG (Cohen et al. 1997): each step builds candidate rows, each from one uncovered pair (the
    first `CANDIDATE_SEEDS` still uncovered) completed factor by factor with the level that
    covers the most uncovered pairs and triples, and keeps the candidate that covers the most
    (ties: the earlier seed) among those the pre-flight accepts (a combination of more levels
    may be refused where its pairs are not); if it refuses them all, the first seed's own row
    (`pair_row`). One candidate per step, replaced by its seed's own row when refused, took 36
    rows on this matrix."""
    wanted = [frozenset(p) for p, why in verdicts.items() if why is None]
    wanted += [frozenset(t) for t, why in (triples or {}).items() if why is None]
    supported = set(wanted)
    refused_triples = {frozenset(t) for t, why in (triples or {}).items() if why is not None}
    uncovered = set(wanted)
    rows: list[Row] = []

    def subsets(levels: list[Level]) -> set[frozenset[Level]]:
        return {frozenset(c) for n in (2, 3) for c in itertools.combinations(levels, n)}

    def fits(lv: Level, row: dict[str, Level]) -> bool:
        others = list(row.values())
        return all(frozenset((lv, o)) in supported for o in others) and not any(
            frozenset((lv, *pair)) in refused_triples for pair in itertools.combinations(others, 2)
        )

    def gain(lv: Level, row: dict[str, Level]) -> int:
        others = list(row.values())
        new = [frozenset((lv, o)) for o in others]
        if refused_triples or triples:
            new += [frozenset((lv, *pair)) for pair in itertools.combinations(others, 2)]
        return sum(t in uncovered for t in new)

    def complete(seed: frozenset[Level]) -> Row:
        seed_levels = sorted(seed, key=lambda lv: list(FACTORS).index(lv.factor))
        row = {lv.factor: lv for lv in seed_levels}
        for factor, levels in FACTORS.items():
            if factor in row:
                continue
            candidates = [lv for lv in levels if fits(lv, row)] or [FIRST[factor]]
            # The level that covers the most uncovered pairs and triples; ties: the earlier one.
            row[factor] = max(candidates, key=lambda lv: (gain(lv, row), -levels.index(lv)))
        return {factor: row[factor] for factor in FACTORS}

    def factors(t: frozenset[Level]) -> frozenset[str]:
        return frozenset(lv.factor for lv in t)

    while uncovered:
        # Seeds from the factor pair with the most pairs left first: a row holds one pair of
        # each factor pair, so the largest (layout × peft) bounds the rows from below.
        left: dict[frozenset[str], int] = {}
        for t in uncovered:
            left[factors(t)] = left.get(factors(t), 0) + 1
        order = sorted(
            (w for w in wanted if w in uncovered), key=lambda w: -left[factors(w)]
        )  # stable: within a factor pair, the input order
        seeds = order[:CANDIDATE_SEEDS]
        built = [(seed, complete(seed)) for seed in seeds]
        # Most newly covered first; sorted() is stable, so ties keep the earlier seed.
        built.sort(key=lambda sr: -len(subsets(list(sr[1].values())) & uncovered))
        accepted = (
            (seed, full)
            for seed, full in built
            if not check_rows or verdict(full, fixtures) is None
        )
        seed, full = next(accepted, (None, None))
        if seed is None or full is None:  # every candidate refused: the first seed's own row
            seed = built[0][0]
            levels = sorted(seed, key=lambda lv: list(FACTORS).index(lv.factor))
            full = pair_row(tuple(levels), helpers)
        rows.append(full)
        uncovered -= subsets(list(full.values()))
        uncovered.discard(seed)
    return prune(rows, supported, fixtures if check_rows else None)


def _compiles(row: Row) -> bool:
    return row["compile"].name == "on"


def prune(rows: list[Row], wanted: set, fixtures: Fixtures | None = None) -> list[Row]:
    """`rows` less what the others already cover, compiled rows first (each costs 2-5 rows
    without compile on 2 cores: Dynamo traces every rank): a compiled row whose compile pairs
    (and triples) all appear in other rows is run eagerly instead (when the pre-flight accepts
    it, or `fixtures` is None), then a row whose every wanted pair and triple appears in another
    row is dropped."""

    def covered(row: Row) -> set[frozenset[Level]]:
        levels = list(row.values())
        return {frozenset(c) for n in (2, 3) for c in itertools.combinations(levels, n)} & wanted

    rows = list(rows)
    order = sorted(range(len(rows)), key=lambda i: not _compiles(rows[i]))  # stable
    for i in order:
        if not _compiles(rows[i]):
            continue
        elsewhere = set().union(*(covered(r) for j, r in enumerate(rows) if j != i))
        if {t for t in covered(rows[i]) if FACTORS["compile"][1] in t} <= elsewhere:
            eager = {**rows[i], "compile": FIRST["compile"]}
            if fixtures is None or verdict(eager, fixtures) is None:
                rows[i] = eager
    kept = list(rows)
    for row in sorted(rows, key=lambda r: not _compiles(r)):
        others = [r for r in kept if r is not row]
        if covered(row) <= set().union(*(covered(r) for r in others)):
            kept = others
    return kept


def pair_rows(
    verdicts: dict[tuple[Level, Level], str | None], helpers: dict[Level, Level | None]
) -> list[Row]:
    """One row per supported pair (`pair_row`), duplicates removed."""
    seen, rows = set(), []
    for pair, why in verdicts.items():
        row = pair_row(pair, helpers)
        key = tuple(lv.name for lv in row.values())
        if why is None and key not in seen:
            seen.add(key)
            rows.append(row)
    return rows
