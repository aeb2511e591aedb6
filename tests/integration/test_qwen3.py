"""Qwen3 end to end: its debug config trains and resumes exactly (on 2 warm ranks, as run_train.sh
trains it: `conftest.run_config`), every
kind of parallelism matches one process, and a run started from an imported Hugging Face
checkpoint logs the loss transformers computes on the same batch."""

import dataclasses

import pytest
import torch

from conftest import CONSTANT_LR, checkpoint_every, read_metrics, run_config
from titanlab.planning.layouts import Layout
from tests.coverage_spec import cover_cases
from tools import parity_matrix

QWEN3 = ["--model.name", "qwen3"]


def test_qwen3_debug_config_trains_and_resumes_exactly(tiny_dataset, tmp_path):
    common = [
        "train_configs/qwen3_debug.toml",
        "--data.dataset_path",
        tiny_dataset,
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
        *CONSTANT_LR,
        *checkpoint_every(4, "--checkpoint.keep_latest_k", "0"),
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for steps, dump in (("8", straight), ("4", resumed), ("8", resumed)):
        proc = run_config(*common, "--training.steps", steps, "--job.dump_folder", str(dump))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model: qwen3 debugmodel" in proc.stdout and "step-4" in proc.stdout
    want, got = read_metrics(str(straight)), read_metrics(str(resumed))
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # bitwise
    assert want[8] < want[1]


LAYOUTS = {
    "fsdp2": Layout(1, 2, 1, 1, None, 1),
    "tp2": Layout(1, 1, 2, 1, None, 1),
    "fsdp2-tp2": Layout(1, 2, 2, 1, None, 1),
    "fsdp2-pp2": Layout(1, 2, 1, 2, "1F1B", 1),
    "hsdp2x1-cp2": Layout(2, 1, 1, 1, None, 1, cp=2),  # replicate and context parallel
}


@pytest.fixture(scope="module")
def qwen3_reference(tiny_dataset, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qwen3_parity"))
    return (*parity_matrix.prepare_reference(root, tiny_dataset, extra=QWEN3), root)


@pytest.mark.parametrize("name", cover_cases("qwen3", list(LAYOUTS), layout=LAYOUTS.get))
def test_qwen3_layout_matches_single_process(name, qwen3_reference):
    dataset, seed, losses, root = qwen3_reference
    outcome = parity_matrix.run_layout(LAYOUTS[name], dataset, seed, losses, root, extra=QWEN3)
    assert outcome.error is None, outcome.report()
    print(
        f"qwen3 {name}: worst |Δloss| over {parity_matrix.STEPS} steps {outcome.max_abs_diff:.3g}"
    )
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]


def _first_batch(dataset: str, seq: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, labels) of step 1 on one rank, built with the trainer's own loader."""
    from titanlab.components import builders as components
    from titanlab.config.manager import build_config
    from titanlab.data.build import build_data, build_loader

    config = build_config(
        [
            "--data.dataset_path",
            dataset,
            "--training.seq_len",
            str(seq),
            "--training.local_batch_size",
            str(batch),
            "--validation.enable",
            "false",
        ]
    )
    tokenizer = components.build_tokenizer(config)
    return next(iter(build_loader(build_data(config, tokenizer).train, config, 0, 1)))


@pytest.mark.parametrize("family", ["qwen3", "llama3", "deepseek_v3"])
def test_run_from_an_imported_checkpoint_logs_transformers_loss(family, tiny_dataset, tmp_path):
    """A random transformers model of a shape no flavor has (9 heads, 3 KV heads, eps 1e-6),
    imported with from-hf, trains with `model.flavor = "hf"` from `initial_load_path`: its
    step-1 loss equals transformers' on the same batch, and its checkpoint stores the shape
    (the bitwise export back is in tests/unit/models/qwen3/test_qwen3_hf.py)."""
    transformers = pytest.importorskip("transformers")
    from titanlab.checkpoint.convert import hf_to_dcp
    from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path

    vocab = Tokenizer(default_tokenizer_path()).vocab_size
    shape = dict(
        vocab_size=vocab,
        hidden_size=72,
        intermediate_size=120,
        num_hidden_layers=3,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(**shape, head_dim=16)
        hf_model = transformers.Qwen3ForCausalLM(config)
    elif family == "deepseek_v3":  # MLA (9 key-value heads), 1 dense block, 4 groups of 2
        config = transformers.DeepseekV3Config(
            **{**shape, "num_key_value_heads": 9}, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32,
            n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, num_mtp_layers=0,
        )  # fmt: skip
        hf_model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**shape)
        hf_model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.05)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), progress=False)

    seq, batch = 64, 2
    dump = tmp_path / "run"
    proc = run_config(
        "train_configs/debug_model.toml",
        "--model.name",
        family,
        "--model.flavor",
        "hf",
        "--checkpoint.enable",
        "true",
        "--checkpoint.initial_load_path",
        str(tmp_path / "dcp"),
        "--checkpoint.export_at_end",
        "false",
        "--data.dataset_path",
        tiny_dataset,
        "--training.steps",
        "1",
        "--training.seq_len",
        str(seq),
        "--training.local_batch_size",
        str(batch),
        "--validation.enable",
        "false",
        "--debug.deterministic",
        "true",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump),
        nproc=1,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ours = read_metrics(str(dump))[1]
    inputs, labels = _first_batch(tiny_dataset, seq, batch)
    with torch.no_grad():
        logits = hf_model(inputs).logits
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    print(f"{family}: step-1 loss titanlab {ours:.7f}, transformers {theirs:.7f}")
    assert abs(ours - theirs) <= 1e-5
    # The run's checkpoint stores the imported shape, for to-hf without --flavor.
    from titanlab.models.stored_args import read_model_args

    stored = read_model_args(str(dump / "checkpoint" / "step-1"))
    assert stored is not None and stored[1] == "hf"
    assert dataclasses.asdict(stored[2])["n_heads"] == 9
