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


def test_bad_input_is_one_line(capsys, tmp_path):
    assert main(["--cluster", "v100", *DEBUG]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster profile 'v100' is not known" in err[0]
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
    assert line.startswith("pre-flight: ws2-fsdp2 passes; memory ") and "--calibrate" in line

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
