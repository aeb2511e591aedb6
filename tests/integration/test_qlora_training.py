"""QLoRA in the trainer (`train_configs/qlora_debug.toml`), from a model imported from a random
`transformers` Llama: at seq_len 8192, batch 1, under FSDP 2 with full AC it trains, its base
weights take under 0.3 of the bf16 LoRA run's bytes per rank and its loss stays within 5% of
bf16 LoRA's; the NF4 values do not depend on the layout (FSDP 2 = 1 process) and a resume is bit
exact; the merged Hugging Face export computes what the NF4 model with its adapters computes.
The 8192-token case is left to `make test-parity-full` (CI meets QLoRA with every other feature
in the feature-pair matrix, and its per-rank bytes in tests/unit/peft/test_qlora.py)."""

import dataclasses
import os
import re
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from conftest import CONSTANT_LR, random_hf_llama_dcp  # noqa: E402
from titanlab.checkpoint.convert import dcp_to_hf  # noqa: E402
from titanlab.checkpoint.streaming import DcpModelReader  # noqa: E402
from titanlab.config.peft import Peft  # noqa: E402
from titanlab.generation.loading import load_model  # noqa: E402
from titanlab.models.llama3 import llama3_flavors  # noqa: E402
from titanlab.peft.lora import LoRALinear, apply_lora  # noqa: E402
from tools import parity_matrix  # noqa: E402
from tools.lib.runs import failure_line, launch, read_losses  # noqa: E402

to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
CONFIG = os.path.join(REPO, "train_configs", "qlora_debug.toml")
FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
LONG_STEPS = 30  # make test-parity-full: 30 steps of 8192 tokens
FULL_ONLY = pytest.mark.skipif(not FULL, reason="make test-parity-full runs it")
SHORT = ["--training.seq_len", "256", "--training.local_batch_size", "2",
         "--training.mixed_precision_on_cpu", "false", "--activation_checkpoint.mode", "selective",
         "--debug.deterministic", "true", "--checkpoint.export_at_end", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A random transformers Llama (dim 256, 2 layers, FFN 768: every Linear splits into whole
    NF4 blocks over 2 ranks), imported to DCP."""
    args = dataclasses.replace(
        llama3_flavors["debugmodel"], n_layers=2, hidden_dim=768, vocab_size=4352
    )
    return random_hf_llama_dcp(str(tmp_path_factory.mktemp("qlora_base")), args, 16384)


def run(nproc: int, dataset: str, base: str, dump: str, *extra: str) -> tuple[dict, str]:
    """(losses by step, output) of qlora_debug.toml on `nproc` ranks."""
    proc = launch(nproc, ["--job.config_file", CONFIG, "--data.dataset_path", dataset,
                          "--job.dump_folder", dump, "--checkpoint.initial_load_path", base,
                          "--comm.init_timeout_seconds", "300", "--comm.train_timeout_seconds",
                          "300", *extra])  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, failure_line(out)
    return read_losses(dump), out


def base_mib(output: str) -> float:
    """The MiB rank 0 logged for the adapted layers' base weights."""
    m = re.search(r"adapted layers' base weights take ([\d.]+) MiB on rank 0", output)
    assert m, output[-2000:]
    return float(m.group(1))


@FULL_ONLY
@pytest.mark.cover("qlora×dp_shard", "ac:full")
def test_at_8k_under_fsdp2_with_full_ac_nf4_trains_like_bf16_lora_in_a_quarter_of_the_bytes(
    base, tiny_dataset, tmp_path
):
    steps = ["--training.steps", str(LONG_STEPS), "--checkpoint.enable", "false"]
    qlora, q_out = run(2, tiny_dataset, base, str(tmp_path / "qlora"), *steps)
    lora, l_out = run(2, tiny_dataset, base, str(tmp_path / "lora"), *steps,
                      "--peft.quantize_base", "none")  # fmt: skip
    ratio = base_mib(q_out) / base_mib(l_out)
    print(f"per-rank base bytes NF4 / bf16 = {ratio:.3f}; loss at step {LONG_STEPS}: "
          f"QLoRA {qlora[LONG_STEPS]:.4f}, LoRA {lora[LONG_STEPS]:.4f}")  # fmt: skip
    assert ratio <= 0.3
    assert sorted(qlora) == list(range(1, LONG_STEPS + 1))
    assert qlora[LONG_STEPS] < qlora[1] - 0.1  # it trains
    assert abs(qlora[LONG_STEPS] - lora[LONG_STEPS]) <= 0.05 * lora[LONG_STEPS]


def test_nf4_does_not_depend_on_the_layout_and_resumes_bit_exact(base, tiny_dataset, tmp_path):
    ckpt = [*SHORT, *CONSTANT_LR, "--checkpoint.interval", "3"]
    whole, _ = run(2, tiny_dataset, base, str(tmp_path / "whole"), *ckpt, "--training.steps", "6")
    one, _ = run(1, tiny_dataset, base, str(tmp_path / "one"), *ckpt, "--training.steps", "6",
                 "--training.local_batch_size", "4")  # fmt: skip
    assert max(abs(one[s] - whole[s]) for s in whole) <= parity_matrix.TOLERANCE, (one, whole)
    # TP 2: column-wise layers keep NF4 row blocks, row-wise ones (wo, w2) column blocks, each
    # dequantizing to the whole weight's values (titanlab.peft.nf4_split).
    tp, _ = run(2, tiny_dataset, base, str(tmp_path / "tp"), *SHORT, *CONSTANT_LR,
                "--checkpoint.enable", "false", "--training.steps", "6",
                "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1")  # fmt: skip
    assert max(abs(one[s] - tp[s]) for s in tp) <= parity_matrix.TOLERANCE, (one, tp)
    parted = str(tmp_path / "parted")
    run(2, tiny_dataset, base, parted, *ckpt, "--training.steps", "3")
    resumed, out = run(2, tiny_dataset, base, parted, *ckpt, "--training.steps", "6")
    assert "loaded" in out and resumed == whole


MORE = {
    "pp2-1F1B": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism."
                 "pipeline_parallel_schedule", "1F1B", "--parallelism.data_parallel_shard_degree",
                 "1", "--training.local_batch_size", "4"),
    "fsdp2-compile": ("--compile.enable", "true"),
    "fsdp2-full-ac": ("--activation_checkpoint.mode", "full"),
    "tp2-compile": ("--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "4", "--compile.enable", "true"),
}  # fmt: skip


MORE_CELLS = {
    "pp2-1F1B": ["qlora×pp", "schedule:1F1B"],
    "fsdp2-compile": ["qlora×dp_shard", "compile×dp_shard"],
    "fsdp2-full-ac": ["qlora×dp_shard", "ac:full"],
    "tp2-compile": ["qlora×tp", "compile×tp"],
}
"""The cover cells (tests/coverage_spec.py) of each case of `MORE`."""


@FULL_ONLY
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.cover(*MORE_CELLS[n])) for n in MORE]
)
def test_more_layouts_equal_fsdp2(name, base, tiny_dataset, tmp_path):
    """QLoRA × PP 2, × compile, × full AC, × TP 2 compiled: the losses of FSDP 2 with
    selective AC within 1e-5."""
    steps = [*SHORT, "--training.steps", "5", "--checkpoint.enable", "false",
             "--training.global_batch_size", "4"]  # fmt: skip
    want, _ = run(2, tiny_dataset, base, str(tmp_path / "fsdp2"), *steps)
    got, _ = run(2, tiny_dataset, base, str(tmp_path / name), *steps, *MORE[name])
    assert max(abs(got[s] - want[s]) for s in want) <= parity_matrix.TOLERANCE, (got, want)


def test_the_merged_export_computes_what_the_nf4_model_computes(base, tiny_dataset, tmp_path):
    transformers = pytest.importorskip("transformers")
    dump = str(tmp_path / "run")
    run(2, tiny_dataset, base, dump, *SHORT, "--training.steps", "4",
        "--checkpoint.export_at_end", "true", "--checkpoint.export_dtype", "float32")  # fmt: skip
    export = os.path.join(dump, "checkpoint", "export-step-4")
    # titanlab's QLoRA forward: the base quantized to NF4 plus the trained adapters, unmerged.
    model, _, _ = load_model(base, torch.device("cpu"))
    apply_lora(model, Peft(method="lora", rank=8, alpha=16.0,
                           target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"]))  # fmt: skip
    reader = DcpModelReader(export)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                nf4 = to_nf4(module.weight.detach(), 64, 256)
                # The export holds the base as the run used it: NF4, dequantized.
                assert torch.equal(reader.load(f"{name}.weight"), nf4.get_original_weight())
                module.weight = torch.nn.Parameter(nf4, requires_grad=False)
                module.lora_a.weight.copy_(reader.load(f"{name}.lora_a.weight"))
                module.lora_b.weight.copy_(reader.load(f"{name}.lora_b.weight"))
        assert reader.load("layers.1.feed_forward.w2.lora_b.weight").abs().max() > 0  # trained
        tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(3))
        want = model(tokens)
        merged = str(tmp_path / "merged")
        dcp_to_hf(export, merged, dtype=torch.float32, merge_lora=True, progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
        got = hf(tokens).logits
    assert (got - want).abs().max() <= 1e-4
