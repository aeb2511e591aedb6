"""The `titanlab` command (titanlab/cli.py): its subcommands' help, one-line errors, the version,
the shipped configs found by name, and what `titanlab train` launches (run_train.sh's steps).

The dispatcher's own answers run as a subprocess, as a user meets them; the subcommands' help
runs in this process where it needs torch (one import for all of them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from titanlab import cli
from titanlab.config import shipped
from titanlab.config.errors import ConfigError
from titanlab.resilience import launcher, run_train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def titanlab(*args: str, cwd: str = REPO, timeout: int = 120) -> subprocess.CompletedProcess:
    """`titanlab ARGS` as the console script runs it (`titanlab.cli:main`)."""
    return subprocess.run([sys.executable, "-m", "titanlab.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cli.main(args)`; argparse's --help exits with SystemExit."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def test_no_arguments_list_the_commands_and_version_prints_it(tmp_path):
    listing = titanlab(cwd=str(tmp_path))
    assert listing.returncode == 0 and listing.stderr == ""
    for name in cli.COMMANDS:
        assert f"\n  {name} " in listing.stdout, name
    version = titanlab("--version", cwd=str(tmp_path))
    assert version.returncode == 0
    assert version.stdout.strip() == f"titanlab {cli.version()}"
    assert cli.version()[0].isdigit()  # the editable install's metadata: 0.1.0


def test_an_unknown_command_is_one_line_with_the_closest_name(tmp_path):
    proc = titanlab("trian", "--training.steps", "2", cwd=str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("titanlab: error: unknown command 'trian'; did you mean 'train'?")
    typo = titanlab("--versoin", cwd=str(tmp_path))  # the options of `titanlab` itself too
    assert typo.returncode == 2
    assert "unknown command '--versoin'; did you mean '--version'?" in typo.stderr
    far = titanlab("xyzzy", cwd=str(tmp_path))
    assert far.returncode == 2 and len(far.stderr.splitlines()) == 1
    assert "did you mean" not in far.stderr and "(commands: train, preflight" in far.stderr


@pytest.mark.parametrize(
    ("command", "names"),
    [
        ("preflight", ["usage: titanlab preflight", "--nproc", "--nnodes", "--job.config_file"]),
        (
            "plan",
            [
                "usage: titanlab plan",
                "--cluster",
                "--nodes",
                "--explain",
                "--apply",
                "--job.config_file F",
                "rank every layout the trainer accepts by",
            ],
        ),
        (
            "ledger",
            [
                "usage: titanlab ledger",
                "--device",
                "--top",
                "--json",
                "(default: the config's comm.dry_run_device, h100 unless it sets another)",
                "on this machine's CPU with fake tensors",
            ],
        ),
        ("generate", ["usage: titanlab generate", "--prompt", "--max-new-tokens", "--top-p"]),
        ("convert", ["usage: titanlab convert", "to-hf", "from-hf", "to-peft", "to-gguf"]),
        ("prepare-data", ["usage: titanlab prepare-data", "--output", "--tokenizer", "--format"]),
    ],
)
def test_each_command_help_names_its_options(capsys, command, names):
    code, out, err = in_process(capsys, command, "--help")
    assert code == 0 and err == ""
    flat = " ".join(out.split())  # argparse wraps the help at the terminal's width
    for name in names:
        assert name in flat, (name, out)


def test_convert_subcommand_help_and_train_and_bench_help(capsys):
    code, out, _ = in_process(capsys, "convert", "to-hf", "--help")
    assert code == 0 and "--max-shard-size" in out and "--merge-lora" in out
    train = titanlab("train", "--help")  # the usage, then the trainer's own option reference
    assert train.returncode == 0, train.stderr
    assert train.stdout.startswith("usage: titanlab train [CONFIG_FILE] [--section.key VALUE ...]")
    for name in ("NGPU", "LOG_RANK", "MAX_RESTARTS", "--training.steps", "--model.flavor"):
        assert name in train.stdout, name
    bench = titanlab("bench", "--help")  # this checkout's tools/benchmark.py
    assert bench.returncode == 0 and "--matrix" in bench.stdout and "--steps" in bench.stdout
    assert bench.stdout.startswith("usage: titanlab bench "), bench.stdout[:200]


def test_bench_without_a_checkout_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(shipped, "checkout_root", lambda: None)  # as from an installed wheel
    code, out, err = in_process(capsys, "bench", "--matrix", "quick")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(
        "titanlab: error: titanlab bench needs a source checkout (tools/benchmark.py); "
    )
    code, out, err = in_process(capsys, "bench", "--help")
    assert code == 0 and "needs a source checkout" in out and err == ""


def test_convert_and_prepare_data_report_bad_input_as_one_titanlab_line(capsys, tmp_path):
    code, _, err = in_process(capsys, "convert", "to-hf", str(tmp_path / "nope"), str(tmp_path))
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("titanlab: error: ") and "is not a folder" in err
    code, _, err = in_process(capsys, "convert", "to-hf", "a", "b", "--dtype", "int8")
    assert code == 2 and err.startswith("titanlab: error: argument --dtype: invalid choice")
    code, _, err = in_process(capsys, "prepare-data", str(tmp_path / "none.txt"))
    assert code == 2 and err.strip() == (
        "titanlab: error: the following arguments are required: --output"
    )


def test_prepare_data_through_titanlab_writes_shards(capsys, tmp_path):
    (tmp_path / "in.txt").write_text("def f(x):\n    return x + 1\n")
    code, out, err = in_process(
        capsys, "prepare-data", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out")
    )
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'out'}: ") and "1 documents, 1 shards" in out
    assert (tmp_path / "out" / "metadata.json").is_file()
    assert err == ""  # no tqdm bar where stderr is not a terminal (captured logs)


def test_shipped_configs_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = os.path.join(REPO, "train_configs", "debug_model.toml")  # the checkout's
    for name in ("debug_model.toml", "debug_model", "train_configs/debug_model.toml"):
        assert shipped.resolve_config_file(name) == expected, name
    assert shipped.checkout_root() == REPO and "llama_8b.toml" in shipped.shipped_configs()
    (tmp_path / "train_configs").mkdir()
    mine = tmp_path / "train_configs" / "debug_model.toml"
    mine.write_text("[training]\nsteps = 3\n")
    assert shipped.resolve_config_file("train_configs/debug_model.toml") == (
        "train_configs/debug_model.toml"  # a file on disk wins, as given
    )
    with pytest.raises(ConfigError, match=r"'debug_modle.toml' does not exist; did you mean 'debug_model.toml'\? \(shipped configs: "):  # fmt: skip
        shipped.resolve_config_file("debug_modle.toml")
    with pytest.raises(ConfigError, match="'elsewhere/debug_model.toml' does not exist"):
        shipped.resolve_config_file("elsewhere/debug_model.toml")  # only train_configs/ maps
    assert shipped.resolve_config_option(["--job.config_file", "qwen3_debug", "--a.b=1"]) == [
        "--job.config_file",
        os.path.join(REPO, "train_configs", "qwen3_debug.toml"),
        "--a.b=1",
    ]
    assert shipped.resolve_config_option(["--job.config_file=llama_8b"]) == [
        "--job.config_file=" + os.path.join(REPO, "train_configs", "llama_8b.toml")
    ]


def test_an_installed_package_finds_its_own_train_configs(tmp_path, monkeypatch):
    """The wheel's layout: site-packages/titanlab/train_configs/, no checkout above it."""
    package = tmp_path / "site-packages" / "titanlab"
    (package / "train_configs").mkdir(parents=True)
    (package / "train_configs" / "debug_model.toml").write_text("[training]\nsteps = 1\n")
    monkeypatch.setattr(shipped, "_PACKAGE", str(package))
    monkeypatch.chdir(tmp_path)
    assert shipped.checkout_root() is None
    assert shipped.shipped_configs() == ["debug_model.toml"]
    assert shipped.resolve_config_file("train_configs/debug_model.toml") == str(
        package / "train_configs" / "debug_model.toml"
    )


def test_train_launches_what_run_train_sh_launches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"NGPU": "3", "LOG_RANK": "0,1", "MAX_RESTARTS": "2", "MASTER_PORT": "29555"}
    launch = run_train.plan_launch(["llama_8b.toml", "--training.steps", "2"], env)
    config = os.path.join(REPO, "train_configs", "llama_8b.toml")
    assert launch.nproc == "3" and launch.comm_mode == ""
    assert launch.torchrun == [
        "--preflight", "--nproc_per_node=3", "--max-restarts=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:29555", "--local-ranks-filter=0,1", "--role=rank", "--tee=3",
        "-m", "titanlab.train", "--job.config_file", config, "--training.steps", "2",
    ]  # fmt: skip
    monkeypatch.setattr(run_train, "gpu_count", lambda: 0)
    default = run_train.plan_launch(["--job.config_file", "qwen3_debug.toml"], {})
    assert default.nproc == "2" and default.config_file.endswith("qwen3_debug.toml")
    assert "--rdzv_endpoint=localhost:0" in default.torchrun
    assert "--local-ranks-filter=0" in default.torchrun and "--max-restarts=0" in default.torchrun
    none = run_train.plan_launch([], {"NGPU": "1"})
    assert none.config_file == os.path.join(REPO, "train_configs", shipped.DEFAULT_CONFIG)
    # comm.mode from the command line (last wins) or the file: one process, no torchrun.
    fake = run_train.plan_launch(["--comm.mode", "fake_backend", "--comm.fake_world_size=8"], {})
    assert fake.comm_mode == "fake_backend" and fake.torchrun == [] and fake.nproc == ""
    (tmp_path / "lt.toml").write_text('[comm]\nmode = "local_tensor"  # simulated\n')
    assert run_train.plan_launch(["lt.toml"], {}).comm_mode == "local_tensor"
    assert run_train.plan_launch(["lt.toml", "--comm.mode=real"], {}).comm_mode == "real"


def test_train_exits_75_after_a_preemption_and_passes_other_codes(monkeypatch, capsys):
    launch = run_train.plan_launch(["--training.steps", "2"], {"NGPU": "2"})
    ran: list[list[str]] = []

    def preempted(argv):  # rank 0 saved step 7 and wrote the marker, torchrun ended by SIGTERM
        ran.append(argv)
        with open(os.environ[launcher.MARKER_ENV], "w") as f:
            f.write("7\n")
        return -15

    monkeypatch.setenv(launcher.MARKER_ENV, "")  # run() sets both; restored after the test
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(run_train.launcher, "main", preempted)
    assert run_train.run(launch) == 75
    assert ran[0][:2] == ["--preflight", "--nproc_per_node=2"]  # the check runs in the agent
    assert capsys.readouterr().err == "titanlab train: preempted after step 7; exit 75 to requeue\n"
    assert not os.path.exists(os.environ[launcher.MARKER_ENV])
    monkeypatch.setattr(run_train.launcher, "main", lambda argv: 4)  # a hang: the rank's code
    assert run_train.run(launch) == 4
    monkeypatch.setattr(run_train.launcher, "main", lambda argv: 2)  # the check refused
    assert run_train.run(launch) == 2


def test_train_bad_input_is_one_line_before_any_launch(tmp_path):
    missing = titanlab("train", "nosuch.toml", cwd=str(tmp_path))
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1
    assert missing.stderr.startswith("titanlab: error: config file 'nosuch.toml' does not exist")
    typo = titanlab("train", "--training.stepz", "3", cwd=str(tmp_path))  # the pre-flight's line
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "titanlab: error: unknown config key training.stepz; did you mean 'training.steps'?"
    )
    assert not (tmp_path / "outputs").exists()  # nothing written


def test_a_gpu_config_refused_on_a_cpu_says_how_to_check_it_for_gpus(capsys, monkeypatch):
    """`titanlab preflight llama_8b.toml` on a CPU machine checks this machine's host memory;
    its one line ends by naming the dry run that checks the config against a GPU profile."""
    import torch

    from titanlab.planning import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory, "available_bytes_per_rank",
                        lambda n: (16 * 2**30, "16.0 GiB of available host memory"))  # fmt: skip
    code, out, err = in_process(capsys, "preflight", "llama_8b.toml")  # the config file first
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("titanlab: error: model.flavor=8B needs about ")
    assert lines[0].endswith(
        "; this checked this machine's host memory: check a GPU run against a GPU profile with "
        "a dry run, `titanlab train CONFIG --comm.mode fake_backend --comm.dry_run_device h100` "
        "(h100, h200, a100, b200)"
    )
