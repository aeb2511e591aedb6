"""A 2-rank FSDP run with profiling on writes one trace per rank per window, and each trace holds
the step's forward, backward and FSDP collectives; with memory snapshots on, each rank writes
its window's memory timeline and peak."""

import json
import os


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
