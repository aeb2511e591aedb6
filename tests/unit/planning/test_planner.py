import dataclasses

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning import planner
from titanlab.planning.cluster import PROFILES
from titanlab.planning.layouts import check_layout

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "512",
         "--training.global_batch_size", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def ranked():
    config = build_config(DEBUG)
    args = planner.model_args_of(config)
    return config, args, planner.plan(config, args, PROFILES["h100"])


def test_every_layout_that_runs_is_valid_fits_and_is_ranked_by_step_time(ranked):
    config, args, cands = ranked
    fitting = [c for c in cands if c.fits]
    assert len(fitting) > 10
    assert all(c.layout.world_size == 8 for c in cands)
    steps = [c.prediction.step_s for c in fitting]
    assert steps == sorted(steps)
    for c in fitting:
        assert check_layout(config, c.layout, 16, args, "cuda") is None
        assert c.memory.total <= PROFILES["h100"].memory_bytes
    refused = [c for c in cands if not c.fits]
    assert refused and all(c.refused and "\n" not in c.refused for c in refused)


def test_a_debug_model_on_one_node_keeps_tensor_parallel_off(ranked):
    """At 0.5k tokens per sample TP's 8 collectives per block are latency-bound (α = 5 µs each
    against microseconds of compute): the best layout splits the samples or the layers
    instead, and its prediction is the sum of its parts."""
    _, _, cands = ranked
    best = cands[0]
    assert best.layout.tp == 1 and best.layout.dp_replicate * best.layout.dp_shard >= 2
    p = best.prediction
    assert p.step_s == pytest.approx(p.compute_s + p.bubble_s + p.optimizer_s + p.exposed_comm_s)


def test_nothing_fits_is_one_line():
    config = build_config(DEBUG)
    args = planner.model_args_of(config)
    tiny = dataclasses.replace(PROFILES["h100"], memory_bytes=1e6)
    with pytest.raises(ConfigError, match="no layout of 8 h100 devices holds") as e:
        planner.plan(config, args, tiny)
    assert "\n" not in str(e.value)


def test_a_global_batch_of_minus_1_is_the_trainers_on_the_configs_own_layout():
    """-1 is local_batch_size × dp of the layout the config launches as (`batch_layout`): the
    ranks tp and pp leave to dp_shard = -1; a set global batch is kept."""
    config = build_config(DEBUG)
    assert planner.global_batch_of(config, 64) == (16, "")
    minus_1 = ["--job.config_file", "train_configs/debug_model.toml"]  # local 16, dp_shard -1
    config = build_config([*minus_1, "--parallelism.tensor_parallel_degree", "2",
                           "--parallelism.pipeline_parallel_degree", "2"])  # fmt: skip
    batch, how = planner.global_batch_of(config, 16)
    assert batch == 16 * 4
    assert how == (" (global_batch_size -1: local_batch_size 16 × dp 4, the config's own "
                   "layout on 16 devices)")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        planner.global_batch_of(config, 6)  # tp 2 × pp 2 does not divide 6
    line = str(e.value)
    assert "\n" not in line and line.startswith("training.global_batch_size=-1 means")
    assert "does not fit 6 devices" in line and "set --training.global_batch_size" in line


def test_a_128k_document_masked_llama_8b_job_on_64_h100s_ranks_ring_against_ulysses():
    """Long context: the planner searches context parallel's ring (both rotations) and Ulysses
    beside each other and ranks them; at 128k tokens with a document mask the ring's
    all-gathered keys and values (2·(cp−1)/cp of the sequence per block) no longer fit at
    cp 8 without TP, while the alltoall ring and Ulysses do (their best layouts print)."""
    config = build_config(["--job.config_file", "train_configs/llama_8b.toml",
                           "--training.seq_len", "131072", "--training.global_batch_size", "8",
                           "--data.document_mask", "true"])  # fmt: skip
    args = planner.model_args_of(config)
    cluster = dataclasses.replace(PROFILES["h100"], nodes=8)
    cands = planner.plan(config, args, cluster, search_ac=False)
    fitting = [c for c in cands if c.fits]
    best = {}
    for c in fitting:
        if c.layout.cp > 1:
            best.setdefault(c.layout.cp_rotate, c)
    print("\n" + "\n".join(
        f"{m}: {c.layout.name} {c.prediction.step_s:.3f} s, {c.memory.total / 2**30:.1f} GiB"
        for m, c in best.items()))  # fmt: skip
    assert {"alltoall", "ulysses", "allgather"} <= set(best)
    assert all(c.layout.cp > 1 for c in fitting[:5])  # 128k tokens need the sequence split
    steps = [c.prediction.step_s for c in fitting]
    assert steps == sorted(steps)
    gathered = [
        c for c in cands if (c.layout.cp, c.layout.tp, c.layout.cp_rotate) == (8, 1, "allgather")
    ]
    assert gathered and not any(c.fits for c in gathered)
