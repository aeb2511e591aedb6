"""`titanlab ledger`: the table and JSON of the debug config's step on 8 fake ranks, and bad
input as one line, exit code 2."""

from __future__ import annotations

import json

from titanlab.ledger.cli import main


def test_the_debug_configs_step_on_8_ranks(tmp_path, capsys):
    out_json = tmp_path / "ledger.json"
    code = main(["debug_model.toml", "--device", "h200", "--comm.fake_world_size", "8",
                 "--top", "5", "--json", str(out_json)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("ledger: llama3 debugmodel") and lines[0].endswith("priced for h200")
    assert "dp_shard=8" in lines[0] and "MFU" in lines[1]
    table = [line for line in lines if line.startswith("| ") and "ms |" not in line]
    assert len(table) == 5
    saved = json.loads(out_json.read_text())
    summary = saved["summary"]
    assert summary["step_s"] > 0 and 0 < summary["mfu"] < 1 and summary["device"] == "h200"
    assert set(summary["seconds_by_phase"]) >= {"forward", "backward", "grad_norm", "optimizer"}
    # FSDP over 8 ranks: the all-gathers and reduce-scatters are there, on dp_shard, overlapped
    # but for the first gather and the last reductions; the gradient norm's all-reduce waits
    ops = {(r["op"], r["phase"]) for r in saved["ops"]}
    assert ("c10d._allgather_base_.default", "forward") in ops
    assert ("c10d._reduce_scatter_base_.default", "backward") in ops
    assert 0 < summary["exposed_comm_s"] < summary["comm_s"]
    low, high = summary["step_range_s"]
    assert low < summary["step_s"] < high
    assert "(perfect overlap)" in lines[1] and "(serialized)" in lines[1]


def test_bad_input_is_one_line(capsys):
    assert main(["debug_model.toml", "--device", "h900"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanlab: error:") and "h900" in err[0]
    piped = ["debug_model.toml", "--comm.fake_world_size", "2",
             "--parallelism.pipeline_parallel_degree", "2"]  # fmt: skip
    assert main(piped) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline_parallel_degree=2" in err[0]


def test_the_same_ledger_behind_the_trainers_dry_run(capsys):
    from titanlab.train import main as train

    config = ["--job.config_file", "train_configs/debug_model.toml", "--comm.mode",
              "fake_backend", "--comm.fake_world_size", "4", "--comm.dry_run_device", "a100"]  # fmt: skip
    assert train([*config, "--comm.ledger", "true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("ledger: llama3 debugmodel"))
    assert lines[head].endswith("priced for a100") and "dp_shard=4" in lines[head]
    assert lines[head + 1].startswith("step ") and "MFU" in lines[head + 1]
    assert not any(line.startswith("dry run: ok") for line in lines)  # the ledger, not the report
    # without the dry run, one line
    assert train(["--job.config_file", "train_configs/debug_model.toml", "--comm.ledger",
                  "true"]) != 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("titanlab: error: comm.ledger=true needs comm.mode=fake_backend")


def test_float16_is_priced_like_bfloat16(capsys):
    """float16 (its loss scaler's host reads, the non-fused optimizer's step counts) records
    and prices: its GEMMs at the tensor-core rate bf16 gets on an H100 (the profiles price both
    at one peak), where it was a 56-line traceback."""
    args = ["debug_model.toml", "--device", "h100", "--top", "3"]
    assert main([*args, "--training.mixed_precision_param", "float16"]) == 0
    half = capsys.readouterr().out.splitlines()
    assert main([*args, "--training.mixed_precision_param", "bfloat16"]) == 0
    bf16 = capsys.readouterr().out.splitlines()
    assert half[2].startswith("GEMM TFLOP by dtype: float16 ") and "bfloat16" not in half[2]
    # the scaler's reads: its scale (`get_scale`, 3 a step) and its overflow flag (1)
    assert half[2].endswith("host syncs: 4") and bf16[2].endswith("host syncs: 0")
    tflop = [float(lines[2].split(";")[0].split()[-1]) for lines in (half, bf16)]
    assert tflop[0] == tflop[1]  # the same GEMMs
    ms = [float(lines[1].split(" ms")[0].split()[-1]) for lines in (half, bf16)]
    assert 0.9 < ms[0] / ms[1] < 1.5, ms  # priced at the same peak (plus the scaler's work)
