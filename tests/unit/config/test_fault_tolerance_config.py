"""`[fault_tolerance]`: every bad value is refused with one line naming it and what is valid."""

import pytest

from titanlab.config.errors import ConfigError
from titanlab.config.manager import build_config

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.replica_count", "3"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["--fault_tolerance.min_replicas", "4"], "fault_tolerance.min_replicas=4 must be in [1, replica_count=3]"),
        (["--fault_tolerance.replica_id", "3"], "fault_tolerance.replica_id=3 must be in [0, 2]"),
        (["--fault_tolerance.sync_steps", "0"], "fault_tolerance.sync_steps=0 must be >= 1"),
        (["--fault_tolerance.outer_momentum", "1.0"], "outer_momentum=1.0 in [0, 1)"),
        (["--fault_tolerance.fragments", "3"], "fault_tolerance.fragments=3 must be >= 1 and divide sync_steps=20"),
        (["--fault_tolerance.fragment_update_alpha", "1.5"], "fragment_update_alpha=1.5 must be in [0, 1]"),
        (["--fault_tolerance.quorum_timeout_seconds", "0"], "fault_tolerance.quorum_timeout_seconds=0.0 must be a number of seconds > 0"),
        (["--parallelism.data_parallel_replicate_degree", "2"],
         "data_parallel_replicate_degree=2: the replica groups are the replicas"),
        (["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree=2 is not supported yet"),
        (["--rl.algorithm", "grpo", "--job.config_file", "train_configs/grpo_debug.toml"],
         "rl.algorithm=grpo is not supported yet"),
        (["--training.mixed_precision_param", "float16"], "mixed_precision_param=float16 is not supported"),
    ],
)  # fmt: skip
def test_each_refusal_is_one_line_naming_the_value(overrides, words):
    with pytest.raises(ConfigError) as raised:
        build_config([*FT, *overrides])
    message = str(raised.value)
    assert "\n" not in message
    assert words in message, message


def test_a_valid_section_builds_and_reads_the_lighthouse_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://host:29510")
    ft = build_config([*FT, "--fault_tolerance.min_replicas", "2"]).fault_tolerance
    assert (ft.enable, ft.replica_count, ft.min_replicas) == (True, 3, 2)
    assert ft.lighthouse_address() == "http://host:29510"
    ft.lighthouse = "http://other:1"
    assert ft.lighthouse_address() == "http://other:1"
