import pytest
import torch

from titanlab.config.manager import build_config
from titanlab.plan import main

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "512",
         "--training.global_batch_size", "16"]  # fmt: skip


def test_the_table_the_explanation_and_an_applied_config(tmp_path, capsys):
    out = str(tmp_path / "plan.toml")
    assert main(["--cluster", "h100", "--top", "3", "--apply", out, *DEBUG]) == 0
    printed = capsys.readouterr().out
    assert "| 1 | ws8-" in printed and "| 4 |" not in printed
    best = printed.split("| 1 | ")[1].split(" |")[0]
    applied = build_config(["--job.config_file", out])
    p = applied.parallelism
    assert best.startswith("ws8")
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree == 8  # fmt: skip
    assert applied.training.global_batch_size == 16
    assert main(["--cluster", "h100", "--explain", best, *DEBUG]) == 0
    explained = capsys.readouterr().out
    assert f"{best}: step" in explained and "memory per device" in explained


def test_gpu_compute_is_the_ledgers_and_the_flop_model_on_request(capsys):
    assert main(["--cluster", "h100", "--top", "1", *DEBUG]) == 0
    ledger, said = capsys.readouterr()
    # a line on stderr when the (minute-long, at 8B) planning starts
    assert said.splitlines() == [
        "plan: ranking the layouts of llama3 debugmodel on 1 × 8 h100 (compute priced by the "
        "per-op ledger: steps recorded on fake tensors, a minute or more on a CPU; --compute "
        "flops is faster) ..."
    ]
    assert main(["--cluster", "h100", "--top", "1", "--compute", "flops", *DEBUG]) == 0
    flops = capsys.readouterr().out
    assert "compute priced by the per-op ledger" in ledger.splitlines()[0]
    assert "compute by the FLOP model" in flops.splitlines()[0]
    rows = [
        next(line for line in t.splitlines() if line.startswith("| 1 |")) for t in (ledger, flops)
    ]
    step = [float(row.split(" | ")[5].replace(",", "")) for row in rows]
    assert step[0] != step[1]  # two pricings of the same layouts


def test_bad_input_is_one_line(capsys, tmp_path):
    assert main(["--cluster", "v100", *DEBUG]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster profile 'v100' is not known" in err[0]
    assert err[0].startswith("titanlab: error: ")  # every command's one prefix (issue 64)
    assert main(["--cluster", "h100", "--explain", "ws8-nonsense", *DEBUG]) == 2
    assert "not a candidate layout" in capsys.readouterr().err


def test_a_top_beyond_the_layouts_that_run_lists_only_those(capsys):
    """--top 1000 with a few dozen candidates: the table holds the layouts that run, and the
    refused ones are listed after it with their reasons, never ranked."""
    assert main(["--cluster", "h100", "--top", "1000", *DEBUG]) == 0
    printed = capsys.readouterr().out
    table, refused = printed.split("layouts do not run")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "layout" not in line]
    assert len(rows) > 10 and "stages need at least as many layers" not in table
    assert "stages need at least as many layers" in refused


def test_the_preflight_shows_the_planners_prediction_beside_its_memory_check(
    tmp_path, capsys, monkeypatch
):
    from titanlab import preflight
    from titanlab.planning import planner
    from titanlab.planning.cluster import PROFILES, save_profile
    from titanlab.planning.perf_model import ModelShape, predict

    argv = ["--job.config_file", "train_configs/debug_model.toml",
            "--job.dump_folder", str(tmp_path / "dump")]  # fmt: skip
    monkeypatch.delenv("TITANLAB_CLUSTER_PROFILE", raising=False)
    assert preflight.main(["--nproc", "2", *argv]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("pre-flight: ws2-fsdp2 passes; memory ")
    if not torch.cuda.is_available():  # no prediction asked for: no word of one on a CPU
        assert "profile" not in line and "--calibrate" not in line, line

    profile = str(tmp_path / "h100.json")
    save_profile(PROFILES["h100"], profile)
    monkeypatch.setenv("TITANLAB_CLUSTER_PROFILE", profile)
    assert preflight.main(["--nproc", "2", *argv]) == 0
    line = capsys.readouterr().out.strip()
    config = build_config(argv)
    args = planner.model_args_of(config)
    lay = planner.layout_of(config, 2, 1)
    want = predict(ModelShape.of(args), planner.run_of(config, "cuda", 32), lay, PROFILES["h100"])
    assert f"predicted on h100: {want.step_s * 1e3:,.1f} ms a step" in line


DOCUMENTED = (
    "python -m titanlab.plan --cluster h100 --nodes 8 --job.config_file train_configs/llama_8b.toml"
)


def test_the_documented_first_example_plans_at_the_batch_its_config_runs(capsys):
    """docs/planning.md's first command. llama_8b.toml leaves global_batch_size at -1, which
    was refused ("the planner needs the samples per optimizer step"); the planner now takes the
    trainer's -1 on the config's own layout: local_batch_size 1 × the 64 FSDP ranks."""
    with open("docs/planning.md", encoding="utf-8") as f:
        assert DOCUMENTED in f.read()
    assert main(DOCUMENTED.split()[3:]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "llama3 8B on 8 × 8 h100 (64 devices, 80 GiB each): seq_len 8192, global batch 64 "
        "(global_batch_size -1: local_batch_size 1 × dp 64, the config's own layout on 64 "
        "devices), bfloat16; compute priced by the per-op ledger"
    )


# The shipped configs with global_batch_size = -1 (set, or the default: the RL ones), but for
# llama3_8b_lora / llama3_8b_qlora (their tokenizer is a downloaded folder) and qlora_debug (it
# needs the base checkpoint).
NOT_HERE = {"llama3_8b_lora", "llama3_8b_qlora", "qlora_debug"}
SMALL = ["debug_model", "deepseek_v3_debug", "distill_debug", "qwen3_debug", "qwen3_moe_debug",
         "sft_lora_debug", "dpo_debug", "grpo_debug", "ppo_debug", "gpt_oss_debug",
         "qwen3_5_debug", "qwen3_5_moe_debug"]  # fmt: skip
LARGE = {
    "llama3_3b_distill_8b": (1, 64, 64),
    "llama_70b": (1, 64, 64),
    "qwen3_8b": (2, 64, 64),
    "qwen3_30b_a3b": (1, 64, 64),
    "gpt_oss_20b": (1, 64, 64),
    "qwen3_5_27b": (1, 64, 64),
    "qwen3_5_35b_a3b": (1, 64, 64),
    "deepseek_v3_671b": (8, 512, 64),  # pp 8: dp 64 of its 512 devices, 512 sequences
}
"""(local_batch_size, devices, dp of the config's own layout on them). Planning each takes
15-35 s on 2 cores (`python -m titanlab.plan --cluster h100 --nodes 8` exits 0 for the first
four), so only the batch is checked here."""


PLANNED = ["debug_model", "qwen3_moe_debug"]
"""Planned end to end here (a dense and an MoE model: 10-25 s each on 2 cores); every config
of SMALL and LARGE has its batch checked below."""


@pytest.mark.parametrize("name", PLANNED)
def test_the_shipped_configs_at_global_batch_minus_1_plan(name, capsys):
    argv = ["--cluster", "h100", "--nodes", "8", "--job.config_file", f"train_configs/{name}.toml"]
    assert main(argv) == 0, capsys.readouterr().err
    local = build_config(argv[4:]).training.local_batch_size
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        f"global batch {local * 64} (global_batch_size -1: local_batch_size {local} × dp 64"
        in first
    )


@pytest.mark.parametrize("name", list(LARGE) + SMALL)
def test_the_shipped_configs_resolve_their_global_batch(name):
    from titanlab.planning import planner

    local, devices, dp = LARGE.get(name) or (None, 64, 64)
    if local is None:  # a debug config on the 64 devices of --nodes 8, FSDP over all of them
        local = build_config(
            ["--job.config_file", f"train_configs/{name}.toml"]
        ).training.local_batch_size
    config = build_config(["--job.config_file", f"train_configs/{name}.toml"])
    assert config.training.global_batch_size == -1
    batch, how = planner.global_batch_of(config, devices)
    assert batch == local * dp
    assert how == (f" (global_batch_size -1: local_batch_size {local} × dp {dp}, the config's "
                   f"own layout on {devices} devices)")  # fmt: skip


def test_every_shipped_config_at_global_batch_minus_1_is_covered():
    import glob
    import os
    import tomllib

    def batch(path: str) -> int:
        with open(path, "rb") as f:
            return tomllib.load(f).get("training", {}).get("global_batch_size", -1)

    shipped = {
        os.path.basename(path)[: -len(".toml")]
        for path in glob.glob("train_configs/*.toml")
        if batch(path) == -1
    }
    assert shipped == {"llama_8b"} | set(SMALL) | set(LARGE) | NOT_HERE  # llama_8b: above
