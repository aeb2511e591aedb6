"""tools/gpu_check.py and tools/gpu_bench_row.py on CPU: the parts that need no GPU (the JUnit
parser, the layer fit, the 8B-shaped config, the report) and a row of the debug model."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from titanlab.components.builders import build_model_args
from titanlab.config.manager import build_config
from tools.gpu_check import (
    ROWS,
    fit_layers,
    model_config,
    parse_junit,
    run_torchtitan_ab,
    trainer_args,
)
from tools.lib.gpu_report import render_report
from tools.lib.runs import REPO

GIB = 2**30


def test_parse_junit_reads_each_outcome(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.a.test_x" name="t1" time="1.5"/>'
        '<testcase classname="tests.a.test_x" name="t2" time="0.1">'
        '<failure message="AssertionError: 3 != 4">trace</failure></testcase>'
        '<testcase classname="tests.b" name="t3" time="0"><skipped message="needs 2 GPUs"/>'
        "</testcase></testsuite></testsuites>"
    )
    got = parse_junit(str(xml))
    assert [(t["name"], t["outcome"], t["msg"]) for t in got] == [
        ("test_x::t1", "passed", ""),
        ("test_x::t2", "failed", "AssertionError: 3 != 4"),
        ("b::t3", "skipped", "needs 2 GPUs"),
    ]


def test_fit_layers_grows_with_memory_and_stays_within_32():
    small, h100, h200 = fit_layers(40 * GIB), fit_layers(80 * GIB), fit_layers(141 * GIB)
    assert 1 <= small < h100 < h200 <= 32


def test_model_config_builds_8b_dims_with_the_chosen_layers(tmp_path):
    folder = model_config(3, str(tmp_path / "m"))
    args = build_model_args(build_config(trainer_args(folder, str(tmp_path / "d"), 5)), 4096)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (4096, 3, 32, 8)
    assert (args.vocab_size, args.ffn_hidden_dim()) == (128256, 14336)


def test_report_lists_tests_rows_ratios_and_errors():
    row = {
        "tps": 1000.0,
        "median_step_s": 8.0,
        "tflops": 400.0,
        "mfu": 0.4,
        "max_allocated": 60 * GIB,
        "estimate_peak_tensors": 50 * GIB,
        "loss_first": 12.0,
        "loss_last": 9.0,
        "profile": {
            "sdpa_ops": ["aten::_scaled_dot_product_cudnn_attention"],
            "gpu_ms_by_kind": {"gemm": 300.0},
            "gpu_ms_total": 400.0,
            "top_kernels_ms": [["nvjet", 1.0]],
        },
    }
    fp8 = dict(row, tps=1300.0)
    info = dict(
        gpu="H100", memory=80 * GIB, capability="9.0", sms=132, driver="580", torch="2.11",
        cuda="13.0", python="3.12", missing=["torchao: the float8 tests and rows"],
    )  # fmt: skip
    tests = [{"name": "test_gpu::t", "outcome": "failed", "s": 1.0, "msg": "a | b"}]
    rows = [(ROWS[0], row), (ROWS[2], fp8), (ROWS[3], {"error": "CUDA out of memory"})]
    text = render_report(info, tests, "1 failed", 10, rows, 120)
    assert "Missing packages: torchao" in text and "a \\| b" in text
    assert "| 1.30× | cudnn_attention | 60.00 | 50.00 | +20.0% |" in text
    assert "CUDA out of memory" in text and "with 10 of its 32" in text


def test_bench_row_runs_the_trainer_on_cpu(tmp_path):
    out = tmp_path / "row.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "gpu_bench_row.py"),
        "--out",
        str(out),
        "--warmup",
        "1",
        "--profile-step",
        "2",
        "--",
        "--job.config_file",
        os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--training.seq_len",
        "64",
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert len(row["step_s"]) == 3 and row["median_step_s"] == pytest.approx(row["step_s"][2])
    assert row["tps"] == pytest.approx(16 * 64 / row["median_step_s"], rel=0.01)
    assert row["loss_last"] < row["loss_first"] and row["max_allocated"] is None
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in row["profile"]["sdpa_ops"]


def test_estimate_error_is_measured_over_estimated():
    from tools.lib.gpu_report import estimate_error

    assert estimate_error({"max_allocated": 110, "estimate_peak_tensors": 100}) == pytest.approx(
        0.1
    )


def test_the_torchtitan_stage_says_in_one_line_why_it_did_not_run(tmp_path, monkeypatch):
    find = importlib.util.find_spec  # torchtitan is in the dev extra: hide it
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchtitan" else find(name, *a))  # fmt: skip
    a = argparse.Namespace(budget_s=570, perf=str(tmp_path / "perf.md"))
    got = run_torchtitan_ab(a, 2, {"memory": 80 * GIB}, time.time())
    assert got == "Not run: torchtitan is not installed (`make peer-wheels`)."
    assert not (tmp_path / "perf.md").exists()
