"""The trainer's pre-flight verdict on each pair of the feature-pair matrix (and on each EP/PP ×
PEFT triple): judged in a row of first levels plus the pair's companions, on worker processes,
remembered per row; and whether a refusal names both levels. `tools/lib/feature_matrix.py`
defines the factors and levels."""

from __future__ import annotations

import itertools
import sys

from tools.lib.feature_matrix import (
    FACTORS,
    WORLD_SIZE,
    Fixtures,
    Level,
    Row,
    row_args,
    row_with,
)


def companions(fixtures: Fixtures) -> dict[Level, Level | None]:
    """For each level the pre-flight refuses next to the first levels alone (expert parallel
    needs an MoE model), the first level of another factor that makes it valid; its pairs are
    then judged next to that level, so a refusal belongs to the pair, not to the context. None:
    no level makes it valid (a LoRA adapter on the router is refused on every model), so each of
    its pairs is refused for the level itself."""
    out: dict[Level, Level | None] = {}
    for levels in FACTORS.values():
        for level in levels:
            if verdict(row_with(level), fixtures) is None:
                continue
            others = (lv for f, lvs in FACTORS.items() if f != level.factor for lv in lvs)
            out[level] = next(
                (lv for lv in others if verdict(row_with(level, lv), fixtures) is None), None
            )
    return out


def pair_row(pair: tuple[Level, ...], helpers: dict[Level, Level | None]) -> Row:
    """The row that judges `pair` (or a triple): first levels, each level's companion, then
    the levels themselves."""
    factors = {lv.factor for lv in pair}
    extra = [h for h in (helpers.get(lv) for lv in pair) if h is not None]
    return row_with(*[lv for lv in extra if lv.factor not in factors], *pair)


_VERDICTS: dict[tuple, str | None] = {}


def verdict(row: Row, fixtures: Fixtures) -> str | None:
    """None when the trainer's pre-flight accepts `row` on 2 ranks, else its one-line refusal.
    Remembered per row (many pairs are judged in the same row: a pair with a first level).
    Judged without the memory estimate (`preflight.check(memory=False)`): a refusal for
    memory names no pair, the debug models' rows never come near a rank's memory, and the
    rows that run check it in every rank; its activation traces were most of the ~550
    verdicts' time (22 of 24 s, 2 processes)."""
    args = tuple(row_args(row, fixtures))
    if args not in _VERDICTS:
        _VERDICTS[args] = _verdict_of_args(args)
    return _VERDICTS[args]


def all_pairs() -> list[tuple[Level, Level]]:
    """Every pair of levels of two different factors, in a fixed order."""
    levels = [lv for levels in FACTORS.values() for lv in levels]
    return [(a, b) for a, b in itertools.combinations(levels, 2) if a.factor != b.factor]


TRIPLE_LAYOUTS = ("ep2", "pp2")


def triple_verdicts(
    fixtures: Fixtures,
    helpers: dict[Level, Level | None],
    verdicts: dict[tuple[Level, Level], str | None],
) -> dict[tuple[Level, Level, Level], str | None]:
    """The triples that touch expert or pipeline parallel and PEFT: (EP 2 or PP 2, a PEFT
    level, a level of any third factor), each whose three pairs are supported, with the
    pre-flight's verdict on it (judged in `pair_row`). A triple can be refused where none of its
    pairs is."""
    supported = {frozenset(p) for p, why in verdicts.items() if why is None}
    triples = [
        (layout, peft, other)
        for layout in FACTORS["layout"]
        if layout.name in TRIPLE_LAYOUTS
        for peft in FACTORS["peft"]
        for factor, levels in FACTORS.items()
        if factor not in ("layout", "peft")
        for other in levels
    ]
    triples = [
        t for t in triples if all(frozenset(p) in supported for p in itertools.combinations(t, 2))
    ]
    prefill_verdicts([pair_row(t, helpers) for t in triples], fixtures)
    return {t: verdict(pair_row(t, helpers), fixtures) for t in triples}


def _verdict_of_args(args: tuple) -> str | None:
    """`verdict`'s pre-flight on one row's options (in a worker process)."""
    from titanlab.config.errors import ConfigError
    from titanlab.config.manager import build_config
    from titanlab.planning import preflight

    try:
        preflight.check(build_config(list(args)), WORLD_SIZE, WORLD_SIZE, memory=False)
        return None
    except ConfigError as e:
        return str(e)


def _untraced() -> None:
    """A judging worker runs without the trace function it inherited from the fork (a
    coverage run's: the pre-flight's fake-tensor traces ran 50 % slower under it); what it
    runs is measured where the trainer runs it."""
    sys.settrace(None)


def prefill_verdicts(rows: list[Row], fixtures: Fixtures, workers: int = 2) -> None:
    """Judge `rows` (those not judged yet) on `workers` processes at once and remember the
    verdicts, so that `verdict` finds them; the pre-flight is single-threaded Python."""
    todo = list(dict.fromkeys(tuple(row_args(r, fixtures)) for r in rows))
    todo = [args for args in todo if args not in _VERDICTS]
    if len(todo) < 2 * workers:
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, initializer=_untraced) as pool:
        for args, why in zip(todo, pool.map(_verdict_of_args, todo, chunksize=8)):
            _VERDICTS[args] = why


def pair_verdicts(
    fixtures: Fixtures, helpers: dict[Level, Level | None]
) -> dict[tuple[Level, Level], str | None]:
    """Each pair's verdict (None: supported, else the pre-flight's refusal line), judged in
    `pair_row`."""
    pairs = all_pairs()
    prefill_verdicts([pair_row(pair, helpers) for pair in pairs], fixtures)
    return {pair: verdict(pair_row(pair, helpers), fixtures) for pair in pairs}


def names_both(
    pair: tuple[Level, Level], message: str, helpers: dict[Level, Level | None] | None = None
) -> bool:
    """Whether a refusal names an option of each level of the pair (the model level counts as
    named by `model.name` or by the model's name, e.g. "MoE" / "qwen3_moe"); a level whose
    companion (`companions`) is named counts as named, since the pair was judged next to it."""

    def named(level: Level) -> bool:
        words = level.option_names
        if level.factor == "model":
            words = [*words, "MoE", "moe", "expert", "dense", "no experts"]
        if level.factor == "data" and level.name == "chat":
            words = [*words, "chat"]
        return any(w in message for w in words)

    helpers = helpers or {}
    alone = [lv for lv in pair if lv in helpers and helpers[lv] is None]
    if alone:  # refused whatever it meets: the refusal must name the level itself
        return all(named(lv) for lv in alone)

    def via_companion(lv: Level) -> bool:
        companion = helpers.get(lv)
        return companion is not None and named(companion)

    return all(named(lv) or via_companion(lv) for lv in pair)
