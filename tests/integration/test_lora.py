"""LoRA in the trainer, from a model imported from a random `transformers` Llama: under FSDP 2
with selective and with full activation checkpointing the losses equal 1 process (1e-5, 5
steps); the checkpoint holds only the adapters and their optimizer state, and a resumed run
continues bit for bit."""

import dataclasses
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from conftest import CONSTANT_LR, random_hf_llama_dcp  # noqa: E402
from tests.coverage_spec import cover_layout  # noqa: E402
from titanlab.checkpoint import store  # noqa: E402
from titanlab.planning.layouts import Layout  # noqa: E402
from titanlab.models.llama3 import llama3_flavors  # noqa: E402
from tools import parity_matrix  # noqa: E402
from tools.lib.runs import failure_line, launch, read_losses  # noqa: E402
from tools.parity_matrix import BASE_ARGS, GLOBAL_BATCH  # noqa: E402

LORA = ["--peft.method", "lora", "--peft.rank", "4",
        "--peft.target_modules", "wq,wk,wv,wo,w1,w2,w3"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A random transformers LlamaForCausalLM of the debugmodel_deep shape, imported to DCP."""
    args = dataclasses.replace(llama3_flavors["debugmodel_deep"], vocab_size=4352)
    return random_hf_llama_dcp(str(tmp_path_factory.mktemp("lora_base")), args, 2048)


def run(layout: Layout, dataset: str, base: str, dump: str, *extra: str) -> dict[int, float]:
    proc = launch(layout.world_size, BASE_ARGS + layout.overrides(GLOBAL_BATCH) + [
        "--data.dataset_path", dataset, "--job.dump_folder", dump,
        "--checkpoint.initial_load_path", base, *LORA, *extra])  # fmt: skip
    assert proc.returncode == 0, failure_line(proc.stdout + proc.stderr)
    return read_losses(dump)


@pytest.fixture(scope="module")
def reference(base, tiny_dataset, tmp_path_factory) -> dict[int, float]:
    """The 1-process LoRA losses of steps 1-5."""
    want = run(Layout(1, 1, 1, 1, None, 1), tiny_dataset, base, str(tmp_path_factory.mktemp("one")))
    assert want[parity_matrix.STEPS] < want[1]  # the adapters learn
    return want


FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)


@FULL_ONLY  # CI: LoRA × FSDP 2 × each AC mode are rows of the feature-pair matrix
@pytest.mark.cover("lora×dp_shard", "ac:full")
def test_fsdp2_with_selective_and_full_ac_equals_one_process(
    base, reference, tiny_dataset, tmp_path
):
    want = reference
    for mode in ("selective", "full"):
        got = run(Layout(1, 2, 1, 1, None, 1), tiny_dataset, base, str(tmp_path / mode),
                  "--activation_checkpoint.mode", mode)  # fmt: skip
        assert sorted(got) == sorted(want)
        assert max(abs(got[s] - want[s]) for s in want) <= parity_matrix.TOLERANCE, (mode, got)


MORE = {
    "fsdp2-tp2": (Layout(1, 2, 2, 1, None, 1), ()),
    "pp2-1F1B": (Layout(1, 1, 1, 2, "1F1B", 1), ()),
    "fsdp2-compile": (Layout(1, 2, 1, 1, None, 1), ("--compile.enable", "true")),
    "hsdp2": (Layout(2, 1, 1, 1, None, 1), ()),
}


def test_tensor_parallel_splits_adapters_with_their_base(base, tiny_dataset, tmp_path):
    """TP 2: A replicated / B by rows under wq, wk, wv, w1, w3 (column-wise); A by columns / B
    replicated under wo, w2 (row-wise); with adapter dropout 0.1 (the mask is keyed by each
    element's position in the whole input, the same on both TP ranks) and full AC (the recompute
    draws the same mask) the losses equal 1 process."""
    drop = ("--peft.dropout", "0.1", "--activation_checkpoint.mode", "full")
    want = run(Layout(1, 1, 1, 1, None, 1), tiny_dataset, base, str(tmp_path / "one"), *drop)
    got = run(Layout(1, 1, 2, 1, None, 1), tiny_dataset, base, str(tmp_path / "tp2"), *drop)
    assert sorted(got) == sorted(want)
    assert max(abs(got[s] - want[s]) for s in want) <= parity_matrix.TOLERANCE, (got, want)


@FULL_ONLY
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=cover_layout("llama3", lay, "lora")) for n, (lay, _) in MORE.items()],
)
def test_more_layouts_equal_one_process(name, base, reference, tiny_dataset, tmp_path):
    """LoRA × FSDP × TP, × PP, × compile and × HSDP (measured here: each within 1e-6 of 1
    process)."""
    layout, extra = MORE[name]
    got = run(layout, tiny_dataset, base, str(tmp_path / name), *extra)
    assert max(abs(got[s] - reference[s]) for s in reference) <= parity_matrix.TOLERANCE


def test_checkpoint_holds_only_adapters_and_resumes_bit_exact(base, tiny_dataset, tmp_path):
    fsdp2 = Layout(1, 2, 1, 1, None, 1)
    ckpt = [*CONSTANT_LR, "--checkpoint.interval", "3", "--training.steps", "6"]
    whole = run(fsdp2, tiny_dataset, base, str(tmp_path / "whole"), *ckpt)
    parted = str(tmp_path / "parted")
    run(fsdp2, tiny_dataset, base, parted, *CONSTANT_LR, "--checkpoint.interval", "3",
        "--training.steps", "3")  # fmt: skip
    keys = store.saved_keys(os.path.join(parted, "checkpoint", "step-3"))
    model = [k for k in keys if k.startswith("model.")]
    optim = [k for k in keys if k.startswith("optimizer.state.")]
    assert model and all(".lora_a." in k or ".lora_b." in k for k in model)
    assert len(model) == 8 * 7 * 2  # 8 layers × 7 Linears × (A, B)
    assert optim and all(".lora_" in k for k in optim)
    resumed = run(fsdp2, tiny_dataset, base, parted, *ckpt)
    assert resumed == whole
