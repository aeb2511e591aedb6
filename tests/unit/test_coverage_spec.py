"""CI's selection meets every cell of the cover (tests/coverage_spec.py): collected as CI
collects `tests/integration`, every family × dimension, schedule, AC mode, precision, launch
path, kill -9 resume per checkpoint mode and pairwise matrix is met by a case CI runs; a
selection that loses the cases of one cell fails the check, naming that cell; every case only
`make test-full` runs declares cells that cases CI runs still meet; and `make test-full` runs
every case CI runs and more."""

import pytest

from tests import coverage_spec as spec

# one worker: the two collections of `tests/integration` (the module fixture) made once
pytestmark = pytest.mark.xdist_group("coverage")


@pytest.fixture(scope="module")
def required():
    return spec.required_cells()


@pytest.fixture(scope="module")
def collections():
    """(items as CI collects tests/integration, items as make test-full collects it)."""
    return spec.collect_both()


@pytest.fixture(scope="module")
def ci_items(collections):
    return collections[0]


def test_the_cover_is_generated_from_the_registry_the_config_and_the_schedules(required):
    from titanlab.models.registry import FAMILIES
    from titanlab.planning.layouts import SCHEDULES

    families = {cell.split("×")[0] for cell in required if "×" in cell}
    assert families == set(FAMILIES)
    # expert parallel where the family has experts, only there
    assert "qwen3_moe×ep" in required and "deepseek_v3×ep" in required
    assert "llama3×ep" not in required and "qwen3_5×ep" not in required
    assert {f"schedule:{s}" for s in SCHEDULES} <= set(required)
    assert {"precision:float32", "precision:bfloat16", "precision:float16"} <= set(required)
    assert {"resume-kill9:disabled", "resume-kill9:async"} <= set(required)
    assert len(required) == len(set(required))


def test_ci_meets_every_cell(required, ci_items):
    assert sum(item["ci"] for item in ci_items) > 100  # the collection saw the suite
    assert spec.missing(required, ci_items) == []
    assert spec.unknown(required, ci_items) == []  # a misspelt cell meets nothing


def test_a_selection_without_the_cases_of_one_cell_fails_naming_it(required, ci_items):
    """The mutants: for each family × dimension cell (and each other cell), CI's selection with
    every case meeting it left out."""
    for cell in required:
        mutant = [dict(item, ci=item["ci"] and cell not in item["cells"]) for item in ci_items]
        assert cell in spec.missing(required, mutant), cell


def test_the_check_reads_skips_as_ci_does(required, ci_items):
    by_id = {item["nodeid"]: item for item in ci_items}
    full_only = "tests/integration/test_parallel_parity.py::test_option_matches_single_process"
    assert by_id[f"{full_only}[cp2_ac_selective_2]"]["ci"] is False
    assert by_id[f"{full_only}[cp2_ac_full]"]["ci"] is True
    # a cell met only by a case CI skips is missing
    only_skipped = [dict(item, ci=False) if "ac:full" in item["cells"] else item
                    for item in ci_items]  # fmt: skip
    assert spec.missing(["ac:full"], only_skipped) == ["ac:full"]


def test_every_moved_case_keeps_its_cells_met_in_ci(collections):
    ci, full = collections
    moved = spec.moved(ci, full)
    assert len(moved) > 100  # the full matrices are there
    assert spec.moved_gaps(ci, full) == []
    assert spec.unknown(spec.required_cells(), full) == []


def test_a_moved_case_whose_cell_ci_no_longer_meets_fails_naming_it(collections):
    """The mutants: a moved case with no cell, and CI's selection without the cases meeting
    one of a moved case's cells (Muon under pipeline parallel)."""
    ci, full = collections
    moved = spec.moved(ci, full)
    case = next(item for item in moved if "muon×pp" in item["cells"])
    bare = [dict(item, cells=[]) if item is case else item for item in full]
    assert spec.moved_gaps(ci, bare) == [f"{case['nodeid']}: declares no cell"]
    without = [dict(item, ci=item["ci"] and "muon×pp" not in item["cells"]) for item in ci]
    gaps = spec.moved_gaps(without, full)
    assert f"{case['nodeid']}: muon×pp is met by no CI case" in gaps


def test_make_test_full_runs_every_case_ci_runs_and_more(required, collections):
    ci_items, full = collections
    ran = {item["nodeid"] for item in full if item["ci"]}
    assert {item["nodeid"] for item in ci_items if item["ci"]} < ran
    assert spec.missing(required, full) == []
