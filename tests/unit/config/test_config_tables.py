"""Arrays of tables in the config ([[data.sources]], [[data.schedule]]): from TOML, from the
command line, written back to config.toml, in --help and the reference; every bad value is one
line."""

import pytest

from titanlab.config.docs import format_help
from titanlab.config.dump import to_toml
from titanlab.config.job_config import ConfigError, DataSource, SchedulePoint
from titanlab.config.manager import build_config

MIXTURE = """
[[data.sources]]
path = "web"
weight = 0.7

[[data.sources]]
path = "code"
weight = 0.3
name = "python"

[[data.schedule]]
step = 0
weights = [0.9, 0.1]

[[data.schedule]]
step = 100
weights = [0.1, 0.9]
"""


def build(tmp_path, text: str, *cli: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return build_config(["--job.config_file", str(path), *cli])


def error(tmp_path, text: str, *cli: str) -> str:
    with pytest.raises(ConfigError) as e:
        build(tmp_path, text, *cli)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_toml_arrays_of_tables_become_dataclasses(tmp_path):
    data = build(tmp_path, MIXTURE).data
    assert data.sources == [DataSource("web", 0.7, ""), DataSource("code", 0.3, "python")]
    assert data.schedule == [SchedulePoint(0, [0.9, 0.1]), SchedulePoint(100, [0.1, 0.9])]


def test_inline_form_and_command_line(tmp_path):
    inline = '[data]\nsources = [{ path = "a" }, { path = "b", weight = 2 }]\n'
    assert build(tmp_path, inline).data.sources == [DataSource("a", 1.0), DataSource("b", 2.0)]
    cli = build(tmp_path, inline, "--data.sources", '[{path = "c", weight = 0.5}]').data
    assert cli.sources == [DataSource("c", 0.5)]


def test_config_toml_reads_back_the_same(tmp_path):
    config = build(tmp_path, MIXTURE)
    text = to_toml(config)
    assert 'sources = [{path = "web", weight = 0.7, name = ""}' in text
    again = build(tmp_path, text)
    assert again.data == config.data


def test_help_lists_the_keys_of_the_tables():
    text = format_help()
    assert "--data.sources (array of tables, default: [])" in text
    assert "weights (list[float]): One weight per source" in text


@pytest.mark.parametrize(
    "text, cli, message",
    [
        ('[[data.sources]]\npath = "a"\nwieght = 1\n', (),
         "unknown key 'wieght' in data.sources[0]; valid: path, weight, name; did you mean 'weight'?"),
        ('[[data.sources]]\npath = "a"\nweight = "x"\n', (), "data.sources[0].weight='x' must be a float"),
        ("[data]\nsources = 3\n", (), "data.sources must be an array of tables"),
        ("", ("--data.sources", "[{path = "), "data.sources='[{path = ' is not a TOML array of tables"),
        ('[[data.sources]]\npath = "a"\nweight = -1\n', (), "data.sources[0].weight=-1.0 must be >= 0"),
        ('[[data.sources]]\npath = "a"\nweight = 0\n', (),
         "data.sources weights=[0.0] must be >= 0 and not all 0"),
        ('[[data.sources]]\nweight = 1\n', (), "data.sources[0].path is empty"),
        ('[data]\ndataset_path = "x"\n[[data.sources]]\npath = "a"\n', (),
         "data.dataset_path and data.sources are both set"),
        ("[[data.schedule]]\nstep = 0\nweights = [1]\n", (), "data.schedule needs [[data.sources]]"),
        (MIXTURE.replace("step = 100", "step = 0"), (),
         "data.schedule is not sorted by step: step 0 (point 1) after step 0"),
        (MIXTURE.replace("[0.1, 0.9]", "[0.1]"), (),
         "data.schedule[1].weights has 1 values for 2 sources"),
        (MIXTURE.replace("[0.1, 0.9]", "[0, 0]"), (),
         "data.schedule[1].weights=[0.0, 0.0] must be >= 0 and not all 0"),
        (MIXTURE.replace("[0.1, 0.9]", '["a", 0.9]'), (),
         "data.schedule[1].weights[0]='a' must be a float"),
    ],
)  # fmt: skip
def test_bad_tables_are_one_line(tmp_path, text, cli, message):
    got = error(tmp_path, text, *cli)
    assert message in got, got
