"""Launching a fault-tolerant job on one machine (`titanlab.resilience.ft_launch`): the
lighthouse, each group's launcher command and GPUs, and when `titanlab train` starts groups."""

import socket
import sys

import pytest

from titanlab.config.errors import ConfigError
from titanlab.resilience import ft_launch
from titanlab.resilience.run_train import local_replica_groups, plan_launch

DEBUG = "train_configs/debug_model.toml"
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.replica_count", "3"]


def test_each_group_gets_its_own_rendezvous_prefix_and_id():
    torchrun = ["--preflight", "--nproc_per_node=2", "--rdzv_endpoint=localhost:29500",
                "--role=rank", "-m", "titanlab.train", "--training.steps", "5"]  # fmt: skip
    cmd = ft_launch.group_command(torchrun, 2)
    assert cmd[:3] == [sys.executable, "-m", "titanlab.launcher"]
    assert "--rdzv_endpoint=localhost:0" in cmd and "--role=g2rank" in cmd
    assert cmd[-2:] == ["--fault_tolerance.replica_id", "2"]
    assert cmd[3:][cmd[3:].index("--training.steps") + 1] == "5"


def test_groups_take_consecutive_gpus_and_too_few_is_one_line():
    assert ft_launch.visible_devices(1, 2, 8) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert ft_launch.visible_devices(3, 4, 0) == {}  # CPU: nothing to split
    with pytest.raises(ConfigError, match=r"group 2 needs GPUs 4-5 \(NGPU=2 per group\)"):
        ft_launch.visible_devices(2, 2, 5)


def test_titanlab_train_starts_the_groups_only_without_a_lighthouse():
    assert local_replica_groups(DEBUG, FT, {}) == 3
    assert local_replica_groups(DEBUG, FT, {"TORCHFT_LIGHTHOUSE": "http://h:1"}) == 0
    assert local_replica_groups(DEBUG, [*FT, "--fault_tolerance.lighthouse", "http://h:1"], {}) == 0
    assert local_replica_groups(DEBUG, [], {}) == 0  # off
    launch = plan_launch([DEBUG, *FT, "--fault_tolerance.min_replicas", "2"], {"NGPU": "2"})
    assert (launch.replica_groups, launch.min_replicas, launch.nproc) == (3, 2, "2")


def test_the_lighthouse_starts_listening_and_stops():
    process, address = ft_launch.start_lighthouse(min_replicas=2)
    try:
        port = int(address.rsplit(":", 1)[1])
        with socket.create_connection(("localhost", port), timeout=5):
            pass
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_bad_config_is_refused_once_before_the_lighthouse_or_any_group_starts(monkeypatch, capfd):
    """min_replicas above the groups: the pre-flight check runs once, in front of everything;
    its one line is the last, and no lighthouse or group was started (each group's own check
    used to print it once per group, a minute after starting them all)."""
    from titanlab.resilience import run_train

    def started(*args, **kwargs):
        raise AssertionError("started the lighthouse or the groups")

    monkeypatch.setattr(ft_launch, "run_groups", started)
    monkeypatch.setattr(ft_launch, "start_lighthouse", started)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("NGPU", "2")
    code = run_train.main([DEBUG, "--fault_tolerance.enable", "true",
                           "--fault_tolerance.replica_count", "2",
                           "--fault_tolerance.min_replicas", "3"])  # fmt: skip
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines[-1] == ("titanlab: error: fault_tolerance.min_replicas=3 must be in [1, "
                         "replica_count=2]")  # fmt: skip
    assert sum("titanlab: error:" in line for line in lines) == 1, lines


@pytest.mark.parametrize(
    "options, says",
    [
        (["--fault_tolerance.min_replicas", "0"], "fault_tolerance.min_replicas=0 must be in [1"),
        (["--fault_tolerance.timeout_seconds", "0"], "timeout_seconds"),
        (
            ["--parallelism.pipeline_parallel_degree", "2"],
            "fault_tolerance.enable=true with parallelism.pipeline_parallel_degree=2",
        ),
        (
            [
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.sync_steps",
                "24",
                "--fault_tolerance.fragments",
                "12",
            ],
            "fault_tolerance.fragments=12 is more than the model's 9 blocks",
        ),
    ],
    ids=["min-replicas-0", "timeout-0", "pipeline", "fragments"],
)
def test_what_a_replica_group_cannot_run_is_refused_by_the_pre_flight_check(options, says, capsys):
    """The check `titanlab train` runs once before the groups: every refusal the groups
    used to meet only after launching (DiLoCo's fragments against the model's blocks too)."""
    from titanlab.planning import preflight_cli

    code = preflight_cli.main(["--nproc", "2", "--job.config_file", DEBUG, *FT[:2],
                               "--fault_tolerance.replica_count", "2", *options])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("titanlab: error: ") and says in err[-1], err
