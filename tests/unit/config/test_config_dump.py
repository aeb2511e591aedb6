"""config.toml reads back to the same config; the start-up lines list only what changed."""

import dataclasses

from titanlab.config.dump import changed_from_defaults, compact_config, to_toml, write_config_toml
from titanlab.config.manager import build_config


def test_written_config_reads_back_equal(tmp_path):
    config = build_config(
        [
            "--job.config_file", "train_configs/debug_model.toml",
            "--job.dump_folder", str(tmp_path / "run"),
            "--job.description", 'quotes " and \\ and ünïcode',
            "--optimizer.lr", "1e-05",
            "--metrics.wandb_tags", "a,b",
            "--compile.components", "model",
        ]
    )  # fmt: skip
    path = write_config_toml(config)
    assert path == str(tmp_path / "run" / "config.toml")
    again = build_config(["--job.config_file", path])
    assert dataclasses.replace(again.job, config_file="") == dataclasses.replace(
        config.job, config_file=""
    )
    for section in ("model", "training", "optimizer", "metrics", "compile", "parallelism"):
        assert getattr(again, section) == getattr(config, section), section


def test_changed_from_defaults_and_compact_lines():
    config = build_config(["--training.steps", "7", "--metrics.log_freq", "3"])
    assert changed_from_defaults(config) == {"training": {"steps": 7}, "metrics": {"log_freq": 3}}
    text = compact_config(config, "/x/config.toml")
    assert text.splitlines() == [
        "config: (no file: defaults and command line); changed from the defaults "
        "(full config: /x/config.toml):",
        "  training: steps=7",
        "  metrics: log_freq=3",
    ]
    assert "[training]\nsteps = 7" in to_toml(config)
