"""Qwen3.5 (dense and MoE hybrids: Gated DeltaNet linear-attention layers with gated full
attention) under data, tensor, pipeline and expert parallelism equals one process, from one seed
checkpoint, fp32, within 1e-5 over 3 steps in CI and 5 in `make test-parity-full` (MoE with
the load-balance loss on); a rank killed with kill -9 resumes bit for bit; and the debug config
trains on 2 CPU ranks with falling loss and its export loads in transformers with equal logits.

The cases are generated from the layouts the trainer's validator accepts for each model (2 and 4
ranks; the linear layers' key heads split with their value heads under TP, their recurrence
over context-parallel ranks through `titanlab.distributed.context_parallel.linear`). CI runs
`NAMED`; `make test-parity-full` (TITANLAB_PARITY_FULL=1) runs every accepted layout.
"""

import json
import os

import pytest
import torch

from conftest import run_config
from tests.coverage_spec import cover_cases
from tools import parity_matrix

FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
STEPS = parity_matrix.STEPS if FULL else parity_matrix.LAYOUT_STEPS
"""Steps compared with the 1-process reference: all of its 5 in the full run, CI's 3."""
OPTIONS = {
    "qwen3_5": ["--model.name", "qwen3_5"],
    "qwen3_5_moe": [
        "--model.name", "qwen3_5_moe",
        "--model.moe_load_balance_coeff", "0.1",  # far above 0.001: a wrong reduction shows
        "--model.moe_bias_update_speed", "0",
    ],
}  # fmt: skip
NAMED = {
    "qwen3_5": ("ws2-tp2", "ws2-pp2-1F1B", "ws2-cp2", "ws4-cp2-tp2"),
    "qwen3_5_moe": ("ws2-tp2-ep2", "ws4-hsdp2x2-ep2", "ws4-cp2-ep2-pp2-1F1B"),
}
"""CI's layouts: the linear layers split by TP, cut between pipeline stages (debugmodel_deep:
layers 3 and 7 full, the rest linear), run on contiguous pieces under context parallel (the
work balancer's shards moved, the prefix state composed; with TP too), and the MoE blocks with
expert parallel under TP, under HSDP, and under CP × PP (every dimension of the MoE family once,
tests/coverage_spec.py). MoE under EP × PP × FSDP (9.5e-7 here), Ulysses and every other
accepted layout run in `make test-parity-full`."""


CASES_POOL = {
    family: parity_matrix.valid_layouts((2, 4), options, with_ep=family.endswith("moe"),
                                        with_cp=True)
    for family, options in OPTIONS.items()
}  # fmt: skip


def _cases() -> list[tuple[str, parity_matrix.Layout]]:
    cases = []
    for family in OPTIONS:
        pool = CASES_POOL[family]
        if FULL:
            cases += [(family, lay) for lay in pool]
            continue
        by_name = {lay.name: lay for lay in pool}
        missing = [name for name in NAMED[family] if name not in by_name]
        assert not missing, f"the validator refuses {missing} for {family}"
        cases += [(family, by_name[name]) for name in NAMED[family]]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    made: dict[tuple[str, int], tuple] = {}

    def get(family: str, microbatches: int):
        if (family, microbatches) not in made:
            root = str(tmp_path_factory.mktemp(f"{family}_{microbatches}"))
            made[family, microbatches] = (
                *parity_matrix.prepare_reference(
                    root, tiny_dataset, extra=OPTIONS[family], microbatches=microbatches
                ),
                root,
            )
        return made[family, microbatches]

    return get


@pytest.mark.parametrize(
    ("family", "layout"),
    cover_cases(lambda c: c[0], CASES, ids=[f"{f}-{lay.name}" for f, lay in CASES]),
)
def test_layout_matches_single_process(family, layout, reference):
    dataset, seed, losses, root = reference(family, parity_matrix.global_microbatches(layout))
    outcome = parity_matrix.run_layout(
        layout, dataset, seed, losses, root, extra=OPTIONS[family], steps=STEPS
    )
    assert outcome.error is None, outcome.report()
    print(f"{family} {layout.name}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (layout.name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]


@pytest.mark.skipif(not FULL, reason="make test-parity-full (TITANLAB_PARITY_FULL=1)")
@pytest.mark.cover("qwen3_5×cp", "ulysses×cp")
def test_ulysses_cp2_matches_single_process(reference):
    """Ulysses: the full layers' heads over the ranks, the linear layers on contiguous pieces
    (Ulysses' shards are contiguous already) from the composed prefix state."""
    layout = next(lay for lay in CASES_POOL["qwen3_5"] if lay.name == "ws2-cp2")
    dataset, seed, losses, root = reference("qwen3_5", 1)
    ulysses = [*OPTIONS["qwen3_5"], "--parallelism.context_parallel_mode", "ulysses"]
    outcome = parity_matrix.run_layout(
        layout, dataset, seed, losses, root, extra=ulysses, steps=STEPS
    )
    assert outcome.error is None, outcome.report()
    print(f"qwen3_5 ws2-cp2 ulysses: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE


@pytest.mark.cover("resume-kill9:async", "qwen3_5×dp_shard", "launch:run_train.sh")
def test_killed_rank_resumes_bit_for_bit(tiny_dataset, tmp_path):
    """kill -9 of rank 1 after the step-4 checkpoint of a Qwen3.5 FSDP 2 run that checkpoints
    asynchronously (`checkpoint.async_mode = "async"`: the kill comes once the background write
    of step 4 is complete): torchrun restarts the group, which trains steps 5-8 bit for bit as
    the straight run (synchronous checkpoints: tests/integration/test_faults.py and the
    Muon and CP document-masking kill tests)."""
    from conftest import assert_killed_rank_resumes_bit_for_bit

    options = [*OPTIONS["qwen3_5"], "--checkpoint.async_mode", "async"]
    assert_killed_rank_resumes_bit_for_bit(tiny_dataset, str(tmp_path), options)


def test_debug_config_trains_on_two_processes_and_its_export_loads_in_transformers(
    tiny_dataset, tmp_path
):
    """train_configs/qwen3_5_debug.toml on 2 warm ranks as run_train.sh trains it (FSDP 2), 16
    steps with falling loss; the final export, converted to-hf, gives transformers'
    Qwen3_5ForCausalLM the logits of titanlab's model within 1e-4 (fp32)."""
    transformers = pytest.importorskip("transformers")
    from titanlab.checkpoint.convert import dcp_to_hf
    from titanlab.generation.loading import load_model

    dump = tmp_path / "run"
    proc = run_config(
        "train_configs/qwen3_5_debug.toml",
        "--data.dataset_path", tiny_dataset, "--training.steps", "16",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.interval", "1000", "--job.dump_folder", str(dump),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "qwen3_5 debugmodel" in proc.stdout
    with open(dump / "metrics.jsonl", encoding="utf-8") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    print(f"qwen3_5_debug: loss {losses[1]:.3f} at step 1, {losses[16]:.3f} at step 16")
    assert losses[16] < losses[1] - 0.5

    export = dump / "checkpoint" / "export-step-16"
    model, _, args = load_model(str(export), torch.device("cpu"))
    dcp_to_hf(str(export), str(tmp_path / "hf"), dtype=torch.float32, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    tokens = torch.randint(5, args.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens).float()).abs().max().item()
    print(f"qwen3_5_debug export in transformers: max |logits diff| {diff:.3g}")
    assert diff <= 1e-4
