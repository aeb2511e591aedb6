"""A 2-rank FSDP run with profiling on writes one trace per rank per window, and each trace holds
the step's forward, backward and FSDP collectives; with memory snapshots on, each rank writes
its window's memory timeline and peak. Tensor parallel with compile, pipeline and context
parallel write their traces too."""

import json
import os

import pytest

from conftest import CI_COMPILE_BACKEND, TINY


def trace_names(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_two_ranks_write_one_trace_per_window_with_fsdp_collectives(train, tmp_path):
    dump = str(tmp_path / "run")
    train(
        2,
        "--training.steps", "4",
        "--parallelism.data_parallel_shard_degree", "2",
        "--profiling.enable_profiling", "true",
        "--profiling.enable_memory_snapshot", "true",
        "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "1",
        dump=dump,
    ).check()  # fmt: skip
    traces = os.path.join(dump, "profile_traces")
    assert sorted(os.listdir(traces)) == ["step-2", "step-4"]
    for window in ("step-2", "step-4"):
        assert sorted(os.listdir(os.path.join(traces, window))) == [
            "rank0_trace.json",
            "rank1_trace.json",
        ]
        for rank in (0, 1):
            names = trace_names(os.path.join(traces, window, f"rank{rank}_trace.json"))
            assert any(n.startswith("ProfilerStep#") for n in names)
            assert f"train_step#{window[5:]}" in names  # the trace names the global step
            assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names  # forward
            assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names
            assert any(n.startswith("FSDP::all_gather") for n in names), sorted(names)[:50]
            assert any(n.startswith("FSDP::post_backward_reduce") for n in names)
            assert "Optimizer.step#AdamW.step" in names
    snapshots = os.path.join(dump, "memory_snapshot")
    for rank in (0, 1):
        with open(os.path.join(snapshots, f"rank{rank}_step4_peak.json"), encoding="utf-8") as f:
            peak = json.load(f)
        assert peak["step"] == 4 and peak["rank"] == rank
        assert peak["window_peak_bytes"] > 0


def test_out_of_memory_in_a_recorded_step_ends_with_one_line_naming_its_snapshot(
    tiny_dataset, tmp_path, monkeypatch, capsys
):
    """A forced allocation failure (an 32 TiB tensor) in step 2, inside a recorded window:
    the run exits with 5 and its last line names the memory timeline written for it."""
    import torch

    from titanlab import train

    real_step = train.Trainer.train_step

    def failing_step(self, batches):
        if self.step == 2:
            torch.empty(2**45, dtype=torch.uint8)
        return real_step(self, batches)

    monkeypatch.setattr(train.Trainer, "train_step", failing_step)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = train.main(
        [
            *TINY,
            "--data.dataset_path", tiny_dataset,
            "--job.dump_folder", str(tmp_path / "run"),
            "--training.steps", "3",
            "--profiling.enable_memory_snapshot", "true",
            "--profiling.profile_freq", "2",
            "--profiling.profiler_warmup", "0",
            "--profiling.profiler_active", "2",
        ]
    )  # fmt: skip
    assert code == 5
    last = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = "titanlab: error: rank 0 ran out of memory in step 2; memory snapshot: "
    assert last.startswith(prefix), last
    path = last[len(prefix) :].split(";")[0]
    assert os.path.basename(path).startswith("rank0_oom_step2") and os.path.exists(path)
    with open(path.rsplit(".", 2)[0] + "_peak.json", encoding="utf-8") as f:
        assert json.load(f)["window_peak_bytes"] > 0  # step 1 of the window was recorded


# One 2-rank layout per parallelism the FSDP test above does not cover, compile included: the
# profiler wraps the whole loop, so each must still write a trace per rank naming the step.
# aot_eager in CI (`CI_COMPILE_BACKEND`): the profiler records its compiled regions as it does
# Inductor's; Inductor's build of the TP block's kernels was 23 of the test's 32 s (2 cores).
LAYOUTS = {
    "tp2-compile": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--compile.enable",
        "true",
        *CI_COMPILE_BACKEND,
    ],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}


TRACE_CELLS = {"tp2-compile": ["profiler×tp", "compile×tp"], "pp2": ["profiler×pp"],
               "cp2": ["profiler×cp"]}  # fmt: skip
"""The cover cells (tests/coverage_spec.py) of each layout."""


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=pytest.mark.cover(*TRACE_CELLS[name])) for name in sorted(LAYOUTS)],
)
def test_traces_under_each_parallelism_and_compile(train, tmp_path, layout):
    dump = str(tmp_path / layout)
    train(
        2,
        "--training.steps", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        *LAYOUTS[layout],
        "--profiling.enable_profiling", "true",
        "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "0",
        "--profiling.profiler_active", "1",
        dump=dump,
    ).check()  # fmt: skip
    window = os.path.join(dump, "profile_traces", "step-2")
    assert sorted(os.listdir(window)) == ["rank0_trace.json", "rank1_trace.json"]
    for rank in (0, 1):
        names = trace_names(os.path.join(window, f"rank{rank}_trace.json"))
        assert "train_step#2" in names
        assert "Optimizer.step#AdamW.step" in names
        assert any(n.startswith("gloo:") for n in names), sorted(names)[:80]  # collectives
        if layout == "tp2-compile":
            assert any("Compiled" in n for n in names), sorted(names)[:80]
