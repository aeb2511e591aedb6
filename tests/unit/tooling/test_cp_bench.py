"""tools/benchmark_cp.py's measurement (tools/lib/cp_bench.py) at a small shape: on 2 gloo
ranks, each method's bytes counted by the communication counter equal their closed form, and
each saves less for backward per rank than one process does; the table renders."""

from __future__ import annotations

import pytest

from tools.benchmark_cp import render
from tools.lib.cp_bench import METHODS, Shape, closed_form_bytes, measure


def test_counted_bytes_equal_the_closed_forms_and_memory_falls(tmp_path):
    shape = Shape(1, 4, 256, 32)
    one = measure(1, METHODS[0], shape, 1, str(tmp_path))
    results = [one]
    for method in METHODS:
        r = measure(2, method, shape, 1, str(tmp_path))
        assert r["kinds"] == closed_form_bytes(method, shape, 2), method
        assert r["saved_bytes"] < one["saved_bytes"], method
        results.append(r)
    table = render(results, shape, 1)
    print("\n" + table)
    assert table.count("✓") == 3


def test_closed_forms_grow_as_the_methods_say():
    shape = Shape(1, 8, 1024, 64)
    shard = 8 * 256 * 64 * 4
    assert closed_form_bytes("ulysses", shape, 4)["all_to_all"] == 8 * shard
    assert closed_form_bytes("ring-alltoall", shape, 4)["send"] == (12 + 8) * shard
    assert closed_form_bytes("ring-allgather", shape, 4)["all_reduce"] == 8 * shard


@pytest.mark.parametrize("method", METHODS)
def test_every_method_has_a_closed_form(method):
    assert closed_form_bytes(method, Shape(), 2)
