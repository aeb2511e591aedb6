"""What CI must meet: the cover, stated once, and the check of a selection of tests against it.

CI (`bash .ci/run`) does not run every case the suite holds: exhaustive lists (every layout of
1-8 ranks, every family × layout, every flavor's dry run, long learning curves) run in
`make test-full` (TITANLAB_PARITY_FULL=1). What CI selects must still meet every *cell* of the
cover below at least once. A cell is a string:

- `<family>×<dim>`: every registered family (`titanlab.models.registry.FAMILIES`) under every
  parallelism dimension its debug flavor supports (`DIMS`; the trainer's validator decides,
  `supported_dims`), trained and checked against a reference;
- `schedule:<name>`: every pipeline schedule (`titanlab.planning.layouts.SCHEDULES`);
- `ac:<mode>`: every activation-checkpointing mode (`AC_MODES`);
- `precision:<dtype>`: every `training.mixed_precision_param`, and float8;
- `launch:<path>`: every way a run starts (`LAUNCH_PATHS`);
- `resume-kill9:<async_mode>`: a run killed with SIGKILL resumes exactly, for each
  `checkpoint.async_mode`;
- `pairs:<matrix>`: a generated pairwise matrix whose own test asserts that every pair it
  generates meets in its rows (`PAIRWISE`).

A test declares the cells it meets with the `cover` marker (`pytest.mark.cover(*cells)`, on
the test, its module's `pytestmark` or a `pytest.param`); a parametrized layout case declares
them with `cover_layout(family, layout)`. `tests/cover_plugin.py` writes, at collection, each
item's cells and whether CI runs it (no skip, and no `skipif` whose condition holds without
TITANLAB_PARITY_FULL); `tests/unit/test_coverage_spec.py` collects `tests/integration` as CI
does and fails when a cell is missing.

    python tests/coverage_spec.py          # the cells, each with the CI cases that meet it
    python tests/coverage_spec.py --moved  # the cases only make test-full runs, and the CI
                                           # cases meeting each of their cells
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIMS = ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep")
"""The parallelism dimensions, by their `parallelism.*_degree` names (ep: expert parallel)."""

LAUNCH_PATHS = (
    "warm-ranks",  # tools/lib/rank_pool.py: the workers most tests train on
    "torchrun",  # a fresh torchrun of titanlab.train
    "run_train.sh",  # the documented entry point
    "titanlab-train",  # the console script
    "slurm",  # multinode_trainer.slurm on a real Slurm cluster
    "ft-groups",  # fault-tolerant replica groups with a lighthouse (run_train.sh)
)
"""Every way a training run starts."""

AC_MODES = ("none", "full", "selective-op", "selective-layer")
"""`activation_checkpoint.mode`, with selective split by `selective_ac_option` (op, or N)."""

PAIRWISE = ("feature-matrix", "layout-matrix")
"""The generated pairwise matrices: `tools/feature_pairs.py`'s covering rows and
`tools/parity_matrix.py`'s pairwise layout subset (each asserted whole by its own test)."""


def _literal(cls: type, field: str) -> tuple[str, ...]:
    return typing.get_args(typing.get_type_hints(cls)[field])


def _probe_layouts():
    """Each dimension at degree 2 on 2 ranks (expert parallel borrows the 2 FSDP ranks)."""
    from titanlab.planning.layouts import Layout

    return {
        "dp_shard": Layout(1, 2, 1, 1, None, 1),
        "dp_replicate": Layout(2, 1, 1, 1, None, 1),
        "tp": Layout(1, 1, 2, 1, None, 1),
        "pp": Layout(1, 1, 1, 2, "1F1B", 1),
        "cp": Layout(1, 1, 1, 1, None, 1, cp=2),
        "ep": Layout(1, 2, 1, 1, None, 1, ep=2),
    }


@functools.cache
def _family_config(family: str):
    from titanlab.components import builders
    from titanlab.config.manager import build_config
    from tools.lib.parity_runs import BASE_ARGS

    config = build_config([*BASE_ARGS, "--model.name", family])
    return config, builders.build_model_args(config, builders.build_tokenizer(config).vocab_size)


def accepts(family: str, layout) -> bool:
    """Whether the trainer's validator (`titanlab.planning.layouts.check_layout`, the
    pre-flight's check) accepts `layout` for `family`'s `debugmodel_deep`."""
    from titanlab.planning.layouts import check_layout
    from tools.lib.parity_runs import GLOBAL_BATCH

    config, model_args = _family_config(family)
    return check_layout(config, layout, GLOBAL_BATCH, model_args, "cpu") is None


def supported_dims(family: str) -> tuple[str, ...]:
    """The dimensions the validator accepts (`accepts`) for `family` at degree 2, alone or with
    expert parallel 2 (an MoE model requires EP where TP splits its blocks)."""

    def accepted(layout) -> bool:
        with_ep = dataclasses.replace(layout, ep=2) if layout.ep == 1 else layout
        return accepts(family, layout) or accepts(family, with_ep)

    return tuple(dim for dim, layout in _probe_layouts().items() if accepted(layout))


def required_cells() -> list[str]:
    """Every cell CI must meet, generated from the registry, the config and the schedules."""
    from titanlab.config.checkpointing import Checkpoint
    from titanlab.config.job_config import Training
    from titanlab.models.registry import FAMILIES
    from titanlab.planning.layouts import SCHEDULES

    cells = [f"{family}×{dim}" for family in FAMILIES for dim in supported_dims(family)]
    cells += [f"schedule:{s}" for s in SCHEDULES]
    cells += [f"ac:{mode}" for mode in AC_MODES]
    precisions = (*_literal(Training, "mixed_precision_param"), "float8")
    cells += [f"precision:{p}" for p in precisions]
    cells += [f"launch:{path}" for path in LAUNCH_PATHS]
    cells += [f"resume-kill9:{mode}" for mode in _literal(Checkpoint, "async_mode")]
    cells += [f"pairs:{matrix}" for matrix in PAIRWISE]
    return cells


def layout_cells(family: str, layout) -> list[str]:
    """The cells a parity case of `family` under `layout` (a `Layout`) meets: the family under
    each of the layout's dimensions above 1, and its pipeline schedule."""
    degrees = {
        "dp_shard": layout.dp_shard,
        "dp_replicate": layout.dp_replicate,
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "ep": layout.ep,
    }
    cells = [f"{family}×{dim}" for dim, degree in degrees.items() if degree > 1]
    return cells + ([f"schedule:{layout.schedule}"] if layout.pp > 1 else [])


def cover_layout(family: str, layout):
    """The `cover` marker of a parity case of `family` under `layout`."""
    import pytest

    return pytest.mark.cover(*layout_cells(family, layout))


def cover_cases(family, cases, ids=None, layout=None) -> list:
    """`cases` (for `pytest.mark.parametrize`), each a `pytest.param` marked with the cells it
    meets (`cover_layout`). `family`: the family's name, or a function of the case;
    `layout`: a function of the case giving its `Layout` (default: the case itself, or the
    first `Layout` in a tuple case); `ids`: the cases' ids, kept."""
    import pytest

    from titanlab.planning.layouts import Layout

    def find(case):
        if layout is not None:
            return layout(case)
        if isinstance(case, Layout):
            return case
        return next(value for value in case if isinstance(value, Layout))

    out = []
    for i, case in enumerate(cases):
        name = family(case) if callable(family) else family
        values = case if isinstance(case, tuple) else (case,)
        mark = cover_layout(name, find(case))
        out.append(pytest.param(*values, marks=mark, id=None if ids is None else ids[i]))
    return out


def missing(required: Iterable[str], items: Iterable[dict]) -> list[str]:
    """The cells of `required` that no item CI runs meets (`items`: `cover_plugin`'s records,
    each with `cells` and `ci`)."""
    met = {cell for item in items if item["ci"] for cell in item["cells"]}
    return [cell for cell in required if cell not in met]


def unknown(required: Iterable[str], items: Iterable[dict]) -> list[str]:
    """Cells that items declare but the cover does not know (a typo meets nothing)."""
    known = set(required)
    return sorted({c for item in items for c in item["cells"] if c not in known})


def collect(paths: Iterable[str] = ("tests/integration",), full: bool = False) -> list[dict]:
    """Collect `paths` in a fresh process as CI does (TITANLAB_PARITY_FULL unset; with `full`,
    as `make test-full` does) and return `cover_plugin`'s record of every item."""
    env = {k: v for k, v in os.environ.items() if k != "TITANLAB_PARITY_FULL"}
    if full:
        env["TITANLAB_PARITY_FULL"] = "1"
    env.setdefault("TITANLAB_SLURM_TESTS", "1")  # CI runs them (.ci/run)
    env.setdefault("TITANLAB_LLAMA_CPP_TESTS", "1")
    with tempfile.TemporaryDirectory(prefix="titanlab_cover_") as tmp:
        out = os.path.join(tmp, "items.json")
        env["TITANLAB_COVER_OUT"] = out
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "-p", "tests.cover_plugin", *paths]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"collection failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
            )
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def _report(moved: bool) -> int:
    required = required_cells()
    items = collect()
    meets: dict[str, list[str]] = {cell: [] for cell in required}
    for item in items:
        for cell in item["cells"]:
            if item["ci"] and cell in meets:
                meets[cell].append(item["nodeid"])
    if not moved:
        for cell, ids in meets.items():
            print(f"{cell}: {len(ids)} CI case(s){', e.g. ' + ids[0] if ids else ' MISSING'}")
    else:  # in make test-full only: skipped in CI, or generated only under TITANLAB_PARITY_FULL
        in_ci = {item["nodeid"] for item in items if item["ci"]}
        for item in collect(full=True):
            if item["ci"] and item["nodeid"] not in in_ci:
                print(item["nodeid"])
                for cell in item["cells"]:
                    print(f"    {cell}: {meets[cell][0] if meets.get(cell) else 'MISSING IN CI'}")
    gaps = missing(required, items)
    print(f"{len(required)} cells, {len(gaps)} missing" + (f": {', '.join(gaps)}" if gaps else ""))
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(_report("--moved" in sys.argv[1:]))
