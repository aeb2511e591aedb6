import json

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.planning.cluster import PROFILES, get_profile, load_profile, save_profile


def test_builtin_profiles_are_the_data_sheets_figures():
    h100 = get_profile("h100")
    assert h100.devices_per_node == 8 and h100.memory_bytes == 81559 * 2**20  # nvidia-smi
    assert h100.flops("bfloat16") == 989e12 and h100.flops("float8") == 1978e12
    assert get_profile("h200").memory_bytes == 143771 * 2**20
    assert get_profile("h100").with_nodes(4).world_size == 32
    with pytest.raises(ConfigError, match="no float8 peak"):
        get_profile("a100").flops("float8")


def test_a_profile_file_round_trips(tmp_path):
    path = str(tmp_path / "p.json")
    save_profile(PROFILES["b200"].with_nodes(2), path)
    assert load_profile(path) == PROFILES["b200"].with_nodes(2)
    assert get_profile(path) == PROFILES["b200"].with_nodes(2)


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", "is malformed"),
        (json.dumps({"name": "x"}), "is malformed"),
        (None, "does not exist"),
    ],
)
def test_bad_profiles_are_one_line(tmp_path, content, words):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=words) as e:
        get_profile(str(path))
    assert "\n" not in str(e.value)


def test_a_negative_bandwidth_is_refused(tmp_path):
    path = str(tmp_path / "p.json")
    save_profile(PROFILES["h100"], path)
    raw = json.load(open(path))
    raw["inter_bandwidth"] = -1
    json.dump(raw, open(path, "w"))
    with pytest.raises(ConfigError, match="inter_bandwidth must be positive"):
        load_profile(path)


def test_an_unknown_profile_names_the_valid_ones():
    with pytest.raises(ConfigError, match="h100, h200, a100, b200") as info:
        get_profile("v100")
    assert "did you mean" not in str(info.value)  # V100 is not an A100
    with pytest.raises(ConfigError, match="'h1000' is not known; did you mean 'h100'"):
        get_profile("h1000")


def test_a_profile_name_in_any_case_is_the_profile():
    """Issue 64: `--comm.dry_run_device H100` and `plan --cluster H100` were refused."""
    assert get_profile("H100") is PROFILES["h100"] and get_profile("B200") is PROFILES["b200"]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("peak_flops", {"bfloat16": 0}, "peak_flops must be positive"),
        ("nodes", 0, "devices_per_node and nodes must be positive"),
        ("efficiency", {"matmul": 1.5}, "efficiency.matmul must be positive"),
        ("efficiency", {"link": 0}, "efficiency.link must be positive"),
        ("split_backward_s", -1e-3, "split_backward_s must be positive .* 0 or more"),
        ("fsdp_gather_s", -1e-3, "fsdp_gather_s must be positive .* 0 or more"),
        ("fsdp_reduce_s", float("nan"), "fsdp_reduce_s must be positive .* 0 or more"),
    ],
)
def test_a_profile_with_an_impossible_field_is_refused(tmp_path, field, value, words):
    path = str(tmp_path / "p.json")
    save_profile(PROFILES["h100"], path)
    raw = json.load(open(path))
    raw[field] = value
    json.dump(raw, open(path, "w"))
    with pytest.raises(ConfigError, match=words) as e:
        load_profile(path)
    assert "\n" not in str(e.value)
