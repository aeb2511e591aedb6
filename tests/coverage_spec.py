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
  generates meets in its rows (`PAIRWISE`);
- `learns:<run>`: a run that must show learning (`LEARNING`) does, in a short form in CI.

A case that only `make test-full` runs (a *moved* case) declares cells too, among them
`<feature>×<dim>`: a feature (`FEATURES`: Muon, LoRA, RL, fault-tolerant groups, ...) under a
parallelism dimension. These are not required of CI by themselves; what is required is that
every cell of every moved case is met by a case CI runs (`moved_gaps`): the property the
moved case checks is still checked in CI, under the same dimension, by another case (the
feature-pair matrix's rows meet each of its features under each layout it supports).

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

LEARNING = ("grpo", "ppo", "dpo", "distill")
"""The runs that must show learning, from a seed or random init (RL's objectives,
distillation's KL): a fixed-step check in CI, the long curve in make test-full."""

FEATURES = (
    "muon",  # optimizer.name Muon
    "qk-clip",  # MuonClip's per-head logit clipping
    "lora",
    "qlora",  # LoRA on an NF4 base
    "distill",
    "chat-sft",  # chat data with the loss on the assistant's tokens
    "document-mask",
    "ulysses",  # context parallel's all-to-all (head-split) attention
    "compile",
    "fused-loss",  # the chunked linear + cross-entropy head
    "profiler",
    "rl",  # one RL update (GRPO, PPO or DPO) on fixed data
    "rl-fused-head",  # RL's log-probabilities from the chunked (fused) head
    "mtp",  # DeepSeek-V3's multi-token prediction
    "ep-capacity",  # expert parallel's capacity-bounded exchange (parallelism.expert_capacity_factor)
    "ft-groups",  # fault-tolerant replica groups, each with a layout of its own
    "ft-heal",  # a killed group restarts and heals from a live peer
    "diloco",
)
"""The features whose cases may move to make test-full, each named in `<feature>×<dim>`."""

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
    expert parallel 2 (an MoE model requires EP where TP splits its blocks), context parallel
    as ring or as Ulysses attention (MLA takes only Ulysses)."""

    def accepted(layout) -> bool:
        with_ep = dataclasses.replace(layout, ep=2) if layout.ep == 1 else layout
        ulysses = [dataclasses.replace(lay, cp_rotate="ulysses") for lay in (layout, with_ep)]
        return any(accepts(family, lay) for lay in (layout, with_ep, *(ulysses * (layout.cp > 1))))

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
    cells += [f"learns:{run}" for run in LEARNING]
    return cells


def feature_cells(feature: str) -> list[str]:
    """The cells `<feature>×<dim>` a case may declare for `feature` (one of `FEATURES`)."""
    if feature not in FEATURES:
        raise ValueError(f"feature {feature!r} is not in FEATURES: {', '.join(FEATURES)}")
    return [f"{feature}×{dim}" for dim in DIMS]


def known_cells(required: Iterable[str]) -> set[str]:
    """The cells a case may declare: the required ones and every feature's `feature_cells`."""
    return set(required) | {cell for feature in FEATURES for cell in feature_cells(feature)}


def layout_dims(layout) -> list[str]:
    """The dimensions (`DIMS`) of `layout` (a `Layout`) above 1."""
    degrees = {
        "dp_shard": layout.dp_shard,
        "dp_replicate": layout.dp_replicate,
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "ep": layout.ep,
    }
    return [dim for dim in DIMS if degrees[dim] > 1]


def layout_cells(family: str, layout, feature: str | None = None) -> list[str]:
    """The cells a parity case of `family` under `layout` (a `Layout`) meets: the family under
    each of the layout's dimensions above 1, and its pipeline schedule; with `feature` (one of
    `FEATURES`), the feature under each of those dimensions too."""
    dims = layout_dims(layout)
    cells = [f"{family}×{dim}" for dim in dims]
    if feature is not None:
        known = feature_cells(feature)
        cells += [f"{feature}×{dim}" for dim in dims if f"{feature}×{dim}" in known]
    return cells + ([f"schedule:{layout.schedule}"] if layout.pp > 1 else [])


def cover_layout(family: str, layout, feature: str | None = None):
    """The `cover` marker of a parity case of `family` under `layout` (`layout_cells`)."""
    import pytest

    return pytest.mark.cover(*layout_cells(family, layout, feature))


def cover_cases(family, cases, ids=None, layout=None, feature=None, marks=None) -> list:
    """`cases` (for `pytest.mark.parametrize`), each a `pytest.param` marked with the cells it
    meets (`cover_layout`). `family`: the family's name, or a function of the case;
    `layout`: a function of the case giving its `Layout` (default: the case itself, or the
    first `Layout` in a tuple case); `feature`: the feature the cases train (`FEATURES`);
    `marks`: a function of the case giving its other marks (a skip); `ids`: the cases' ids,
    kept."""
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
        mark = cover_layout(name, find(case), feature)
        extra = tuple(marks(case)) if marks is not None else ()
        out.append(pytest.param(*values, marks=(mark, *extra), id=None if ids is None else ids[i]))
    return out


def missing(required: Iterable[str], items: Iterable[dict]) -> list[str]:
    """The cells of `required` that no item CI runs meets (`items`: `cover_plugin`'s records,
    each with `cells` and `ci`)."""
    met = {cell for item in items if item["ci"] for cell in item["cells"]}
    return [cell for cell in required if cell not in met]


def unknown(required: Iterable[str], items: Iterable[dict]) -> list[str]:
    """Cells that items declare but the cover does not know (`known_cells`; a typo meets
    nothing)."""
    known = known_cells(required)
    return sorted({c for item in items for c in item["cells"] if c not in known})


def moved(ci_items: Iterable[dict], full_items: Iterable[dict]) -> list[dict]:
    """The cases only make test-full runs: run in `full_items` (collected as make test-full
    collects, `collect(full=True)`) and not in `ci_items` (as CI collects)."""
    in_ci = {item["nodeid"] for item in ci_items if item["ci"]}
    return [item for item in full_items if item["ci"] and item["nodeid"] not in in_ci]


def moved_gaps(ci_items: list[dict], full_items: list[dict]) -> list[str]:
    """One line for each moved case (`moved`) that declares no cell, or a cell no case CI runs
    meets: what make test-full checks and CI no longer does."""
    met = {cell for item in ci_items if item["ci"] for cell in item["cells"]}
    gaps = []
    for item in moved(ci_items, full_items):
        if not item["cells"]:
            gaps.append(f"{item['nodeid']}: declares no cell")
        gaps += [f"{item['nodeid']}: {cell} is met by no CI case"
                 for cell in item["cells"] if cell not in met]  # fmt: skip
    return gaps


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


def collect_both(paths: Iterable[str] = ("tests/integration",)) -> tuple[list[dict], list[dict]]:
    """(`collect(paths)`, `collect(paths, full=True)`), the two collections run at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        ci, full = pool.map(lambda full: collect(paths, full=full), (False, True))
    return ci, full


def moved_table(ci_items: list[dict], full_items: list[dict]) -> str:
    """Markdown: each test function with cases only make test-full runs, their ids, and for each
    cell they declare a case CI runs that meets it."""
    meets: dict[str, str] = {}
    for item in ci_items:
        for cell in item["cells"]:
            if item["ci"]:
                meets.setdefault(cell, item["nodeid"])
    groups: dict[str, list[dict]] = {}
    for item in moved(ci_items, full_items):
        groups.setdefault(item["nodeid"].split("[")[0], []).append(item)
    total = sum(len(items) for items in groups.values())
    lines = [f"{total} cases in make test-full only, in {len(groups)} test functions.", ""]
    for function, items in groups.items():
        params = [item["nodeid"][len(function) :] for item in items]
        lines += [f"### `{function}`", "", f"{len(items)} moved: {' '.join(params)}", "",
                  "| cell | met in CI by |", "|---|---|"]  # fmt: skip
        for cell in sorted({cell for item in items for cell in item["cells"]}):
            lines.append(f"| `{cell}` | `{meets.get(cell, 'NOTHING')}` |")
        lines.append("")
    return "\n".join(lines)


def _report(moved_cases: bool) -> int:
    required = required_cells()
    items, full = collect_both()
    if not moved_cases:
        meets: dict[str, list[str]] = {cell: [] for cell in required}
        for item in items:
            for cell in item["cells"]:
                if item["ci"] and cell in meets:
                    meets[cell].append(item["nodeid"])
        for cell, ids in meets.items():
            print(f"{cell}: {len(ids)} CI case(s){', e.g. ' + ids[0] if ids else ' MISSING'}")
    else:
        print(moved_table(items, full))
    gaps = missing(required, items) + moved_gaps(items, full)
    print(f"{len(required)} cells, {len(gaps)} gaps" + (":\n" + "\n".join(gaps) if gaps else ""))
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(_report("--moved" in sys.argv[1:]))
