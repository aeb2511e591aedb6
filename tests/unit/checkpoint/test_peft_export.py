"""LoRA export: the merged Hugging Face folder gives titanlab's logits (1e-4) and the PEFT folder,
loaded with `peft` onto the Hugging Face base, gives them too; misuse is one line."""

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlab.checkpoint.convert import ConversionError, dcp_to_hf
from titanlab.config.peft import Peft
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model, get_family
from titanlab.models.stored_args import write_model_args
from titanlab.checkpoint.peft_export import dcp_to_peft
from titanlab.peft.lora import apply_lora, init_adapters, is_adapter
from titanlab.peft.stored import write_peft_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, vocab_size=4352, max_seq_len=32)  # fmt: skip
# The output head too: its adapter is exported as PEFT's lm_head, merged, and loaded.
PEFT = Peft(
    method="lora",
    rank=4,
    alpha=8.0,
    target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"],
)


def save(folder, sd, peft=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": sd, "train_state": {"step": 1}}, checkpoint_id=str(folder), no_dist=True)
    write_model_args(str(folder), get_family("llama3"), ARGS)
    if peft:
        write_peft_config(str(folder), PEFT)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(LoRA model with trained-looking adapters, export folder, base-only folder)."""
    root = tmp_path_factory.mktemp("lora_export")
    torch.manual_seed(0)
    model = build_model(ARGS)
    model.init_weights()
    apply_lora(model, PEFT)
    init_adapters([model], seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0, 0.05)  # B starts at 0; make the adapters matter
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save(root / "export", sd)
    save(root / "base", {k: v for k, v in sd.items() if not is_adapter(k)}, peft=False)
    return model.eval(), root


def test_merged_folder_gives_titanlab_logits(lora):
    transformers = pytest.importorskip("transformers")
    model, root = lora
    dcp_to_hf(str(root / "export"), str(root / "merged"), dtype=torch.float32, merge_lora=True,
              progress=False)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "merged")).eval()
    tokens = torch.randint(0, 4352, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)


def test_peft_folder_on_the_hf_base_gives_titanlab_logits(lora):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model, root = lora
    dcp_to_hf(str(root / "base"), str(root / "hf_base"), dtype=torch.float32, progress=False)
    assert dcp_to_peft(str(root / "export"), str(root / "adapter")) == 15  # 2 × 7 + the head
    base = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf_base"))
    with_adapter = peft.PeftModel.from_pretrained(base, str(root / "adapter")).eval()
    tokens = torch.randint(0, 4352, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(tokens).logits, model(tokens), atol=1e-4, rtol=0)


def test_misuse_is_one_line(lora, tmp_path):
    _, root = lora
    with pytest.raises(ConversionError, match="holds LoRA adapters: pass --merge-lora"):
        dcp_to_hf(str(root / "export"), str(tmp_path / "x"), progress=False)
    with pytest.raises(ConversionError, match="holds no LoRA adapters"):
        dcp_to_peft(str(root / "base"), str(tmp_path / "y"))
    proc = subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", "to-hf", str(root / "base"),
         str(tmp_path / "z"), "--merge-lora", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1
    assert (
        lines[0]
        == f"convert_checkpoint: error: --merge-lora: {str(root / 'base')!r} holds no LoRA adapters"
    )


def test_generation_loads_the_export_with_its_adapters_merged(lora, tmp_path):
    from titanlab.generation.loading import load_model

    model, root = lora
    merged, _, _ = load_model(str(root / "export"), torch.device("cpu"))
    tokens = torch.randint(0, 4352, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), model(tokens), atol=1e-4, rtol=0)
    adapters_only = tmp_path / "step"
    save(adapters_only, {k: v for k, v in model.state_dict().items() if is_adapter(k)})
    with pytest.raises(ValueError, match="holds LoRA adapters without their base") as e:
        load_model(str(adapters_only), torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_an_adapter_no_exporter_knows_fails_the_export(tmp_path):
    """Nothing that trained is dropped: an adapter of a layer without a Hugging Face name (here a
    renamed copy of one) stops to-peft, --merge-lora and generation with one line."""
    from titanlab.generation.loading import load_model

    model = build_model(ARGS)
    apply_lora(model, PEFT)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    sd["layers.0.attention.wx.lora_a.weight"] = sd.pop("layers.0.attention.wq.lora_a.weight")
    save(tmp_path / "odd", sd)
    message = "adapter layers.0.attention.wx.lora_a.weight: titanlab exports adapters of"
    with pytest.raises(ConversionError, match=message):
        dcp_to_peft(str(tmp_path / "odd"), str(tmp_path / "adapter"))
    with pytest.raises(ConversionError, match=message):
        dcp_to_hf(str(tmp_path / "odd"), str(tmp_path / "hf"), merge_lora=True, progress=False)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "odd"), torch.device("cpu"))
