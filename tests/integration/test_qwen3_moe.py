"""Qwen3-MoE under data and pipeline parallelism equals one process, from one seed checkpoint,
fp32, 5 steps, within 1e-5: with the load-balance loss, and separately with the
auxiliary-loss-free expert bias (whose values after 5 steps are equal too). The debug MoE config
trains through run_train.sh with expert-load lines in its log.

The load-balance loss is a statistic of each global microbatch (the ranks' k-th microbatches
together), so a layout that accumulates gradients or pipelines microbatches is compared with a
one-process run split into the same global microbatches. The expert bias depends on the step's
total counts only: every layout is compared with the undivided run.
"""

import json
import os
import subprocess

import pytest
import torch

from conftest import REPO
from titanlab.checkpoint.convert import DcpModelReader
from titanlab.distributed.layouts import Layout
from tools import parity_matrix

BALANCING = {
    # A coefficient far above Qwen3's 0.001, so a wrongly reduced aux gradient shows in 5 steps.
    "aux_loss": ["--model.moe_load_balance_coeff", "0.1", "--model.moe_bias_update_speed", "0"],
    "expert_bias": ["--model.moe_load_balance_coeff", "0", "--model.moe_bias_update_speed", "0.01"],
}
# layout, global microbatches per step (pipeline microbatches are 1 sample)
LAYOUTS = {
    "fsdp2": (Layout(1, 2, 1, 1, None, 1), 1),
    "ddp2": (Layout(2, 1, 1, 1, None, 1), 1),
    "hsdp2x2": (Layout(2, 2, 1, 1, None, 1), 1),
    "fsdp2-ga2": (Layout(1, 2, 1, 1, None, 2), 2),
    "pp2": (Layout(1, 1, 1, 2, "1F1B", 1), 8),
    "fsdp2-pp2": (Layout(1, 2, 1, 2, "1F1B", 1), 4),
}
ALL_CASES = [
    (b, n)
    for b in BALANCING
    for n in LAYOUTS
    if b == "aux_loss" or n in ("fsdp2", "fsdp2-ga2", "fsdp2-pp2")
]
# CI: each balancing mode meets sharding, replication, accumulation and pipelining once (HSDP
# is replicate × shard); `make test-parity-full` (TITANLAB_PARITY_FULL=1) runs every case.
CI_CASES = [
    ("aux_loss", "hsdp2x2"),
    ("aux_loss", "fsdp2-ga2"),
    ("aux_loss", "fsdp2-pp2"),
    ("expert_bias", "fsdp2-ga2"),
    ("expert_bias", "fsdp2-pp2"),
]
CASES = ALL_CASES if os.environ.get("TITANLAB_PARITY_FULL") == "1" else CI_CASES


def moe_options(mode: str) -> list[str]:
    return ["--model.name", "qwen3_moe", *BALANCING[mode]]


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """(mode, microbatches) -> (dataset, seed, 1-process losses, root), made on first use."""
    made: dict = {}

    def get(mode: str, microbatches: int):
        if (mode, microbatches) not in made:
            root = str(tmp_path_factory.mktemp(f"moe_{mode}_mb{microbatches}"))
            made[mode, microbatches] = (
                *parity_matrix.prepare_reference(
                    root, tiny_dataset, extra=moe_options(mode), microbatches=microbatches
                ),
                root,
            )
        return made[mode, microbatches]

    return get


def _biases(dump: str) -> dict[str, torch.Tensor]:
    reader = DcpModelReader(os.path.join(dump, "checkpoint", f"step-{parity_matrix.STEPS}"))
    return {k: reader.load(k) for k in reader.tensors if k.endswith("expert_bias")}


@pytest.mark.parametrize("mode, name", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_moe_layout_matches_single_process(mode, name, reference):
    layout, microbatches = LAYOUTS[name]
    dataset, seed, losses, root = reference(mode, microbatches if mode == "aux_loss" else 1)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=moe_options(mode))
    assert outcome.error is None, outcome.error
    print(f"qwen3_moe {mode} {name}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]
    if mode == "expert_bias":
        want = _biases(os.path.join(root, "reference"))
        got = _biases(os.path.join(root, "runs", layout.name))
        assert want and want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), "expert biases differ"
        assert any(v.abs().sum() > 0 for v in want.values())  # the bias did move


def _run_debug_config(tiny_dataset, dump, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            os.path.join(REPO, "run_train.sh"),
            "train_configs/qwen3_moe_debug.toml",
            "--data.dataset_path",
            tiny_dataset,
            "--training.steps",
            str(steps),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--metrics.log_freq",
            "1",
            "--validation.enable",
            "false",
            "--debug.deterministic",
            "true",
            "--lr_scheduler.warmup_steps",
            "2",
            "--lr_scheduler.decay_ratio",
            "0",
            "--model.moe_bias_update_speed",
            "0.01",  # both balancing methods on: the bias is checkpointed state
            "--checkpoint.interval",
            "6",
            "--checkpoint.keep_latest_k",
            "0",
            "--checkpoint.export_at_end",
            "false",
            "--job.dump_folder",
            str(dump),
        ],
        cwd=REPO,
        env=dict(os.environ, NGPU="2", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_moe_debug_config_trains_logs_expert_load_and_resumes_exactly(tiny_dataset, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for steps, dump in ((12, straight), (6, resumed), (12, resumed)):
        proc = _run_debug_config(tiny_dataset, dump, steps)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "active per token" in proc.stdout and "step-6" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if "expert max/mean load:" in ln]
    assert len(lines) == 6 and "moe_aux_loss:" in lines[0] and "(bias " in lines[0]  # 7..12

    def records(dump):
        with open(dump / "metrics.jsonl", encoding="utf-8") as f:
            return {r["step"]: r for r in map(json.loads, f)}

    want, got = records(straight), records(resumed)
    assert [got[s]["loss"] for s in range(1, 13)] == [want[s]["loss"] for s in range(1, 13)]
    assert got[12]["moe/0/bias_norm"] == want[12]["moe/0/bias_norm"] > 0
    assert want[12]["loss"] < want[1]["loss"]
    assert {"moe/0/max_load", "moe/0/mean_load", "moe/0/aux_loss", "moe/aux_loss"} <= set(want[1])
