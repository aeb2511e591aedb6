"""build_config: defaults < TOML file < command line, and one-line errors for every bad input."""

import dataclasses
import glob
import os
import typing

import pytest

from titanlab.config.docs import field_docs, format_help, markdown_reference, sections
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.config.manager import build_config, load_toml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRAIN_CONFIGS = sorted(glob.glob(os.path.join(REPO, "train_configs", "*.toml")))


def write_toml(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def build_from(tmp_path, toml: str, *cli: str) -> JobConfig:
    return build_config(["--job.config_file", write_toml(tmp_path, toml), *cli])


def config_error(argv: list[str]) -> str:
    """The message of the ConfigError that `argv` raises; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        build_config(argv)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def all_fields() -> list[tuple[str, str, type]]:
    """(section, key, section class) for every field of every section."""
    return [(sec, f.name, cls) for sec, cls in sections() for f in dataclasses.fields(cls)]


# --- precedence -------------------------------------------------------------------------------
def test_defaults_without_arguments():
    config = build_config([])
    assert config.training.steps == 1000
    assert config.optimizer.lr == 8e-4
    assert config.lr_scheduler.decay_type == "linear"
    assert config.checkpoint.enable is False
    assert config.compile.components == ["model", "loss"]
    assert config.job.config_file == ""


def test_toml_overrides_defaults(tmp_path):
    config = build_from(tmp_path, "[training]\nsteps = 20\nseq_len = 64\n[optimizer]\nlr = 0.003\n")
    assert (config.training.steps, config.training.seq_len, config.optimizer.lr) == (20, 64, 0.003)
    assert config.training.local_batch_size == 8  # untouched field keeps its default
    assert config.job.config_file.endswith("job.toml")


@pytest.mark.parametrize("cli", [["--training.steps", "7"], ["--training.steps=7"]])
def test_cli_overrides_toml(tmp_path, cli):
    config = build_from(tmp_path, "[training]\nsteps = 20\nseq_len = 64\n", *cli)
    assert config.training.steps == 7
    assert config.training.seq_len == 64


def test_cli_value_containing_equals_sign():
    config = build_config(["--job.description=a=b"])
    assert config.job.description == "a=b"


@pytest.mark.parametrize(
    "cli, expected",
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "--training.steps", "3"], True),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable=true"], True),
        (["--checkpoint.enable", "0"], False),
    ],
)
def test_bool_flags(tmp_path, cli, expected):
    config = build_from(tmp_path, "[checkpoint]\nenable = true\n" if not expected else "", *cli)
    assert config.checkpoint.enable is expected


def test_bare_bool_flag_keeps_following_option():
    config = build_config(["--checkpoint.enable", "--training.steps", "3"])
    assert config.training.steps == 3


@pytest.mark.parametrize(
    "cli, expected",
    [
        (["--compile.components", "model"], ["model"]),
        (["--compile.components", "model,loss"], ["model", "loss"]),
        (["--compile.components=loss"], ["loss"]),
        # The TOML file's spelling, as a shell passes it: the list, not ['["model"', '"loss"]'].
        (["--compile.components", '["model","loss"]'], ["model", "loss"]),
        (["--compile.components", "['loss']"], ["loss"]),
    ],
)
def test_list_option_from_cli(cli, expected):
    assert build_config(cli).compile.components == expected


def test_a_broken_toml_list_on_the_command_line_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_config(["--peft.target_modules", '["wq",'])
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("peft.target_modules='[\"wq\",' is not a TOML array (")


def test_list_option_from_toml(tmp_path):
    assert build_from(tmp_path, '[compile]\ncomponents = ["loss"]\n').compile.components == ["loss"]


def test_int_accepted_for_float_field(tmp_path):
    config = build_from(
        tmp_path,
        "[optimizer]\nlr = 1\n[lr_scheduler]\ndecay_ratio = -1\n",
        "--metrics.peak_flops",
        "2",
    )
    assert config.optimizer.lr == 1.0 and type(config.optimizer.lr) is float
    assert (
        config.lr_scheduler.decay_ratio == -1.0 and type(config.lr_scheduler.decay_ratio) is float
    )
    assert config.metrics.peak_flops == 2.0 and type(config.metrics.peak_flops) is float


def test_negative_number_is_a_value_not_an_option():
    config = build_config(
        ["--training.global_batch_size", "-1", "--lr_scheduler.decay_ratio", "-1"]
    )
    assert config.training.global_batch_size == -1
    assert config.lr_scheduler.decay_ratio == -1.0


# --- errors: one line naming the bad item -----------------------------------------------------
def test_unknown_section_in_toml_suggests_closest(tmp_path):
    message = config_error(["--job.config_file", write_toml(tmp_path, "[trainig]\nsteps = 3\n")])
    assert message == "unknown config section [trainig]; did you mean 'training'?"


def test_unknown_section_on_cli_suggests_closest():
    message = config_error(["--optimzer.lr", "0.1"])
    assert message == "unknown config section [optimzer]; did you mean 'optimizer'?"


def test_unknown_section_without_close_match():
    assert config_error(["--zzz.lr", "0.1"]) == "unknown config section [zzz]"


def test_unknown_key_suggests_closest():
    message = config_error(["--training.stepz", "3"])
    assert message == "unknown config key training.stepz; did you mean 'training.steps'?"


def test_unknown_key_in_toml(tmp_path):
    message = config_error(
        ["--job.config_file", write_toml(tmp_path, "[optimizer]\nweight_decayy = 0.1\n")]
    )
    assert message == (
        "unknown config key optimizer.weight_decayy; did you mean 'optimizer.weight_decay'?"
    )


def test_wrong_type_in_toml(tmp_path):
    message = config_error(
        ["--job.config_file", write_toml(tmp_path, '[training]\nsteps = "ten"\n')]
    )
    assert message == "training.steps='ten' must be an int"


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("[training]\nsteps = 10.0\n", "training.steps=10.0 must be an int"),
        ("[training]\nsteps = true\n", "training.steps=True must be an int"),
        ('[optimizer]\nlr = "big"\n', "optimizer.lr='big' must be a float"),
        (
            '[checkpoint]\nenable = "yes"\n',
            "checkpoint.enable='yes' must be a bool (true or false)",
        ),
        ("[job]\ndump_folder = 3\n", "job.dump_folder=3 must be a string"),
        (
            '[compile]\ncomponents = "model"\n',
            "compile.components='model' must be a list of strings",
        ),
    ],
)
def test_wrong_types_in_toml(tmp_path, toml, expected):
    assert config_error(["--job.config_file", write_toml(tmp_path, toml)]) == expected


@pytest.mark.parametrize(
    "cli, expected",
    [
        (["--training.steps", "ten"], "training.steps='ten' must be an int"),
        (["--training.steps=1.5"], "training.steps='1.5' must be an int"),
        (["--optimizer.lr", "fast"], "optimizer.lr='fast' must be a float"),
        (
            ["--checkpoint.enable", "maybe"],
            "checkpoint.enable='maybe' must be a bool (true or false)",
        ),
    ],
)
def test_wrong_types_on_cli(cli, expected):
    assert config_error(cli) == expected


def test_literal_not_in_choices_lists_valid_ones():
    message = config_error(["--lr_scheduler.decay_type", "cosin"])
    assert message == (
        "lr_scheduler.decay_type='cosin' is not valid; valid: linear, cosine, sqrt; "
        "did you mean 'cosine'?"
    )


def test_a_validated_choice_suggests_the_closest_too():
    """Issue 64: `--comm.mode fake-backend` had no did-you-mean where other options do."""
    assert config_error(["--comm.mode", "fake-backend"]) == (
        "comm.mode='fake-backend' is not one of default, fake_backend, local_tensor; "
        "did you mean 'fake_backend'?"
    )


def test_a_bool_in_a_message_is_spelled_as_the_command_line_spells_it():
    """Issue 64: `optimizer.muon_nesterov=False` in a message; the command line says false."""
    message = config_error(["--optimizer.name", "AdamW", "--optimizer.muon_nesterov", "false"])
    assert message.startswith("optimizer.muon_nesterov=false sets Muon's parameter groups")


def test_literal_in_toml(tmp_path):
    toml = '[training]\nmixed_precision_param = "fp8"\n'
    message = config_error(["--job.config_file", write_toml(tmp_path, toml)])
    assert message == (
        "training.mixed_precision_param='fp8' is not valid; valid: bfloat16, float32, float16"
    )


@pytest.mark.parametrize(
    "cli, expected",
    [
        (["--training.steps=0"], "training.steps=0 must be >= 1"),
        (["--optimizer.lr=-1"], "optimizer.lr=-1.0 must be > 0"),
        (["--data.val_fraction=1.5"], "data.val_fraction=1.5 must be in [0, 1)"),
        (
            ["--parallelism.tensor_parallel_degree=0"],
            "parallelism.tensor_parallel_degree=0 must be >= 1",
        ),
        (
            ["--parallelism.pipeline_parallel_degree=0"],
            "parallelism.pipeline_parallel_degree=0 must be >= 1",
        ),
        (
            ["--parallelism.data_parallel_shard_degree=0"],
            "parallelism.data_parallel_shard_degree=0 must be -1 or >= 1",
        ),
        (["--training.global_batch_size=0"], "training.global_batch_size=0 must be -1 or >= 1"),
        (["--optimizer.beta2=1"], "optimizer.beta2=1.0 must be in [0, 1)"),
        (
            ["--lr_scheduler.decay_ratio=1.5"],
            "lr_scheduler.decay_ratio=1.5 must be -1 or in [0, 1]",
        ),
        (
            ["--lr_scheduler.min_lr_factor=-0.1"],
            "lr_scheduler.min_lr_factor=-0.1 must be in [0, 1]",
        ),
        (["--checkpoint.load_step=-2"], "checkpoint.load_step=-2 must be -1 or >= 0"),
        (
            ["--training.skip_nonfinite_steps=-2"],
            "training.skip_nonfinite_steps=-2 must be -1 (no check) or >= 0 (the non-finite "
            "steps in a row to skip before stopping)",
        ),
        (
            ["--training.skip_nonfinite_steps=3", "--rl.algorithm=grpo"],
            "training.skip_nonfinite_steps=3 checks the pretraining and fine-tuning step; "
            "rl.algorithm=grpo runs its own updates (set training.skip_nonfinite_steps=-1)",
        ),
        (
            ["--activation_checkpoint.selective_ac_option=0"],
            "activation_checkpoint.selective_ac_option='0' must be 'op' or a positive integer",
        ),
        (
            ["--compile.components=model,graph"],
            "compile.components has ['graph']; valid: model, loss",
        ),
        (["--model.flavor="], "model.flavor must not be empty"),
        (["--job.dump_folder="], "job.dump_folder must not be empty"),
    ],
)
def test_out_of_range_values(cli, expected):
    assert config_error(cli) == expected


def test_out_of_range_value_from_toml(tmp_path):
    message = config_error(["--job.config_file", write_toml(tmp_path, "[training]\nsteps = 0\n")])
    assert message == "training.steps=0 must be >= 1"


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    assert config_error(["--job.config_file", path]) == f"config file {path!r} does not exist"


def test_malformed_toml(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = = 3\n")
    message = config_error(["--job.config_file", path])
    assert message.startswith(f"config file {path!r} is not valid TOML: ")
    assert "line 2" in message


def test_non_table_section(tmp_path):
    path = write_toml(tmp_path, "training = 5\n")
    assert config_error(["--job.config_file", path]) == (
        f"[training] in {path} must be a table of key = value"
    )


def test_top_level_key_is_an_unknown_section(tmp_path):
    path = write_toml(tmp_path, "steps = 5\n")
    assert config_error(["--job.config_file", path]) == "unknown config section [steps]"


@pytest.mark.parametrize("cli", [["--training.steps"], ["--training.steps", "--optimizer.lr", "1"]])
def test_option_without_value(cli):
    assert config_error(cli) == "option --training.steps needs a value"


@pytest.mark.parametrize(
    "cli, junk", [(["train.toml"], "train.toml"), (["--training.steps", "3", "extra"], "extra")]
)
def test_positional_junk(cli, junk):
    assert config_error(cli) == (
        f"unexpected argument {junk!r}; options look like --section.key VALUE"
    )


def test_option_without_section():
    assert config_error(["--steps", "3"]) == "option --steps must look like --section.key"


# --- documentation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, key, cls", all_fields(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_field_has_a_docstring(section, key, cls):
    assert field_docs(cls).get(key, "").strip(), f"{section}.{key} has no docstring"


def test_field_docs_reads_the_string_under_the_field():
    cls = dict(sections())["training"]
    assert field_docs(cls)["steps"] == "Number of optimizer steps to train for."


def test_help_mentions_every_option_with_its_default():
    text = format_help()
    for section, key, cls in all_fields():
        default = getattr(cls(), key)
        assert f"--{section}.{key} (" in text, key
        line = next(line for line in text.splitlines() if f"--{section}.{key} (" in line)
        assert line.endswith(f"default: {default!r})"), line


def test_markdown_reference_has_one_row_per_field():
    text = markdown_reference()
    rows = [line for line in text.splitlines() if line.startswith("| `") and "[]." not in line]
    expected = [f"{section}.{key}" for section, key, _ in all_fields()]
    table_rows = [line.split("`")[1] for line in text.splitlines() if "[]." in line]
    assert table_rows == ["data.sources[].path", "data.sources[].weight", "data.sources[].name",
                          "data.schedule[].step", "data.schedule[].weights"]  # fmt: skip
    assert [row.split("`")[1] for row in rows] == expected
    for row in rows:
        cells = row.replace("\\|", "").strip("|").split("|")
        assert len(cells) == 4, (
            row
        )  # option | type | default | meaning: any '|' in a doc is escaped
    assert text.count("#### `[") == len(sections())


def test_sections_match_job_config_fields():
    names = [name for name, _ in sections()]
    assert names == [f.name for f in dataclasses.fields(JobConfig)]
    assert all(typing.get_type_hints(JobConfig)[name] is cls for name, cls in sections())


# --- shipped configs ----------------------------------------------------------------------------
def test_train_configs_exist():
    assert TRAIN_CONFIGS, "no train_configs/*.toml found"


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=os.path.basename)
def test_train_config_parses(path, tmp_path):
    extra = []
    if load_toml(path)["model"].get("flavor") == "hf":  # the shape comes with the base checkpoint
        from titanlab.models.llama3 import llama3_flavors
        from titanlab.models.registry import get_family
        from titanlab.models.stored_args import write_model_args

        base = dataclasses.replace(llama3_flavors["debugmodel"], hidden_dim=768, vocab_size=4352)
        write_model_args(str(tmp_path), get_family("llama3"), base)
        extra = ["--checkpoint.initial_load_path", str(tmp_path)]
    config = build_config(["--job.config_file", path, *extra])
    assert config.job.config_file == path
    for section, table in load_toml(path).items():  # every value in the file reached the config
        for key, value in table.items():
            if not (extra and f"{section}.{key}" == "checkpoint.initial_load_path"):
                assert getattr(getattr(config, section), key) == value, f"{section}.{key}"
    from titanlab.components import builders as components

    args = components.build_model_args(config, 4352)  # the family and flavor are registered
    assert args.vocab_size == 4352 and args.max_seq_len == config.training.seq_len


@pytest.mark.parametrize("name", ["llama_8b", "llama_70b", "llama_405b"])
def test_large_presets_compile_and_checkpoint_activations(name):
    config = build_config(
        ["--job.config_file", os.path.join(REPO, "train_configs", f"{name}.toml")]
    )
    assert config.compile.enable and config.compile.components == ["model", "loss"]
    assert config.activation_checkpoint.mode in ("selective", "full")
    assert config.training.mixed_precision_param == "bfloat16"
