"""The model registry: families, flavors, `model.flavor = "hf"` and stored model args."""

import dataclasses
import json
import os

import pytest
import torch

from titanlab.components import builders as components
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.models.registry import (
    FAMILIES,
    build_model,
    family_of_args,
    family_of_hf_config,
    format_families,
    get_family,
    matching_flavor,
)
from titanlab.models.common.shortened import shortened
from titanlab.models.stored_args import read_model_args, write_model_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def args_of(*argv: str, vocab: int = 300):
    return components.build_model_args(build_config(["--training.seq_len", "32", *argv]), vocab)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_flavor_of_every_family_builds_on_meta(name):
    family = get_family(name)
    for flavor, args in family.flavors.items():
        args = dataclasses.replace(args, vocab_size=max(args.vocab_size, 64), max_seq_len=8)
        with torch.device("meta"):
            model = build_model(args)
        assert isinstance(model, family.model_cls), flavor
        assert family_of_args(args) is family
        assert matching_flavor(family, args) == flavor


def test_hf_model_type_finds_the_family():
    assert family_of_hf_config({"model_type": "qwen3"}).name == "qwen3"
    assert family_of_hf_config({"model_type": "llama"}).name == "llama3"
    with pytest.raises(ValueError, match="model_type='gpt2'; valid: llama, qwen3"):
        family_of_hf_config({"model_type": "gpt2"})


def test_help_lists_every_family_and_its_flavors():
    text = format_families()
    for name in FAMILIES:
        assert f"  {name}: " in text
        assert ", ".join(get_family(name).flavors) in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model.name", "gpt2"], "model.name='gpt2' is unknown; valid: llama3, qwen3"),
        (
            ["--model.name", "qwen3", "--model.flavor", "70B"],
            "model.flavor='70B' is unknown for model.name='qwen3'; valid: debugmodel, "
            "debugmodel_deep, 0.6B, 1.7B, 4B, 8B, 14B, 32B, or 'hf'",
        ),
        (["--model.flavor", "hf"], 'model.flavor="hf" needs model.hf_config'),
        (
            ["--model.flavor", "8B", "--model.n_layers", "33"],
            "model.n_layers=33: llama3 8B has 32 blocks; use 1..32, or 0 for all",
        ),
        (["--model.n_layers", "-1"], "model.n_layers=-1 must be >= 0 (0: every block)"),
        (
            ["--model.flavor", "hf", "--model.hf_config", "/nowhere/config.json"],
            "model.hf_config='/nowhere/config.json' does not exist; give a Hugging Face "
            "config.json or the folder holding it",
        ),
    ],
)
def test_bad_model_choices_are_one_line_config_errors(argv, message):
    with pytest.raises(ConfigError) as e:
        args_of(*argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_n_layers_builds_the_first_blocks_of_every_family():
    for name in FAMILIES:
        whole = args_of("--model.name", name, "--model.flavor", "debugmodel")
        short = args_of(
            "--model.name", name, "--model.flavor", "debugmodel", "--model.n_layers", "2"
        )
        assert short.n_layers == 2 and short.dim == whole.dim, name
    # DeepSeek-V3 671B: block 0 dense as published, block 1 of the MoE kind of its last 58
    v3 = args_of("--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.n_layers", "2")
    assert (v3.n_layers, v3.n_dense_layers) == (2, 1)


def test_hf_flavor_takes_the_architecture_of_a_config_json(tmp_path):
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 20,
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["--model.name", "qwen3", "--model.flavor", "hf", "--model.hf_config", str(tmp_path)]
    args = args_of(*argv)
    assert (args.dim, args.n_layers, args.head_dim, args.hidden_dim, args.vocab_size) == (
        96,
        3,
        20,
        200,
        512,
    )
    assert args.max_seq_len == 32  # the training seq_len
    # ... while checkpoints record what the model serves: the config's context length.
    assert components.context_length(build_config(["--training.seq_len", "32", *argv]), 300) == 4096
    with pytest.raises(
        ConfigError, match="tokenizer has 600 ids but the model's vocab_size is 512"
    ):
        args_of(*argv, vocab=600)
    with pytest.raises(ConfigError, match="describes a qwen3 model but model.name='llama3'"):
        args_of("--model.flavor", "hf", "--model.hf_config", str(tmp_path))


def test_stored_args_are_picked_up_from_initial_load_path(tmp_path):
    family = get_family("llama3")
    custom = dataclasses.replace(
        family.flavors["debugmodel"], dim=72, n_heads=9, n_kv_heads=3, vocab_size=400
    )
    write_model_args(str(tmp_path), family, custom)
    loaded = read_model_args(str(tmp_path))
    assert loaded is not None and loaded[1] == "hf" and loaded[2] == custom
    load = ["--checkpoint.initial_load_path", str(tmp_path)]
    args = args_of(*load, "--model.flavor", "hf")
    assert dataclasses.replace(args, max_seq_len=custom.max_seq_len) == custom
    with pytest.raises(
        ConfigError, match="holds a llama3 model of flavor 'hf', not model.flavor='debugmodel'"
    ):
        args_of(*load)
    with pytest.raises(ConfigError, match="holds a llama3 model; set model.name='llama3'"):
        args_of(*load, "--model.name", "qwen3", "--model.flavor", "hf")
    # A run of a flavor's first blocks stores "hf"; the options that saved it load it, with
    # the checkpoint's own (padded) vocab, as a stored shape of the flavor's own name does.
    shallow = dataclasses.replace(shortened(family.flavors["debugmodel"], 2), vocab_size=320)
    write_model_args(str(tmp_path), family, shallow)
    args = args_of(*load, "--model.n_layers", "2")
    assert dataclasses.replace(args, max_seq_len=0) == dataclasses.replace(shallow, max_seq_len=0)
    with pytest.raises(ConfigError, match="flavor 'hf', not model.flavor='debugmodel'"):
        args_of(*load, "--model.n_layers", "3")
    (tmp_path / "model_args.json").write_text('{"name": "llama3", "args": {"dim": -1}}')
    with pytest.raises(ConfigError, match="is not a valid titanlab model_args.json"):
        args_of(*load, "--model.flavor", "hf")


def test_checkpoints_record_the_context_length_not_the_training_seq_len():
    """A model trained at seq_len 128 serves any position up to its flavor's context length:
    model_args.json and config.json say so, so generation takes longer prompts."""
    for argv, want in [
        (["--model.flavor", "debugmodel"], 131072),  # Llama 3.1 scaling
        (["--model.flavor", "8B"], 131072),
        (["--model.name", "qwen3", "--model.flavor", "8B"], 40960),
        (["--model.flavor", "debugmodel", "--training.seq_len", "262144"], 262144),
    ]:
        config = build_config(["--training.seq_len", "128", *argv])
        assert components.context_length(config, 4352) == want, argv
        assert components.build_model_args(config, 4352).max_seq_len == config.training.seq_len
