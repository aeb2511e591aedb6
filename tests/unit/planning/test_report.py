"""`--explain`'s first line is the step's arithmetic: its terms add up to the step."""

import dataclasses
import re

import pytest

from titanlab.config.manager import build_config
from titanlab.planning import planner
from titanlab.planning.cluster import PROFILES
from titanlab.planning.report import explain

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "512",
         "--training.global_batch_size", "16"]  # fmt: skip


def test_the_explained_terms_add_up_to_the_step_with_the_measured_overheads():
    config = build_config(DEBUG)
    cluster = dataclasses.replace(
        PROFILES["h100"], fsdp_gather_s=1e-3, fsdp_reduce_s=2e-3, tp_block_s=5e-4
    )
    ranked = [c for c in planner.plan(config, planner.model_args_of(config), cluster) if c.fits]
    fsdp = next(c for c in ranked if c.layout.dp_shard > 1 and c.layout.tp > 1)
    first = explain(fsdp).splitlines()[0]
    step, *terms = (float(x) for x in re.findall(r"(?:= |\+ |step )[a-zA-Z ]*?(\d+\.\d+)", first))
    assert "FSDP overhead" in first and "TP overhead" in first
    assert fsdp.prediction.fsdp_overhead_s > 0 and fsdp.prediction.tp_overhead_s > 0
    assert sum(terms) == pytest.approx(step, abs=1e-3)
