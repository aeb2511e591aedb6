"""Activation offloading: the saved tensors of each block go through host copies and come back
for backward with the same gradients (host to host on CPU, the bookkeeping without a device);
with activation checkpointing too; on CUDA the device memory held after forward falls. On CPU
`apply_offload` is a no-op that says so."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.distributed.activation_offload import (
    OffloadSavedTensors,
    apply_offload,
    wrap_blocks,
)
from titanlab.models.registry import build_model, get_family, get_flavor


def tiny(device: str = "cpu"):
    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel"), n_layers=3,
                               vocab_size=512, max_seq_len=64)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args)
        model.init_weights()
    return model


def grads(model, tokens) -> dict[str, torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.cross_entropy(
        model(tokens).flatten(0, 1).float(), tokens.flatten()
    ).backward()
    # activation checkpointing wraps each block: its parameter names gain a wrapper's part
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
            for n, p in model.named_parameters()}  # fmt: skip


@pytest.mark.parametrize("ac", ["none", "full"])
def test_offloaded_saved_tensors_give_the_same_gradients(ac):
    tokens = torch.randint(0, 512, (2, 64))
    want = grads(tiny(), tokens)
    model = tiny()
    apply_ac(model, ac)
    hooks = OffloadSavedTensors("cpu", min_bytes=0)
    wrap_blocks(list(model.layers.values()), hooks)
    got = grads(model, tokens)
    assert hooks.offloaded > 0
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-6, rtol=0), name


def test_asking_for_offloading_without_a_gpu_is_one_line_before_launch(tmp_path):
    from titanlab.config.job_config import ConfigError
    from titanlab.config.manager import build_config
    from titanlab.planning import preflight

    config = build_config(["--activation_checkpoint.offload", "true", "--job.dump_folder",
                           str(tmp_path / "run"), "--model.flavor", "debugmodel"])  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: offloading is accepted")
    with pytest.raises(ConfigError) as e:
        preflight.check(config, 1, 1)
    assert str(e.value) == (
        "activation_checkpoint.offload=true needs a CUDA GPU; on cpu the activations already "
        "live in host memory; set activation_checkpoint.offload=false"
    )
    assert not (tmp_path / "run").exists()  # nothing written


def test_on_cpu_apply_offload_is_a_no_op_that_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="titanlab"):
        assert apply_offload([], torch.device("cpu")) is None
    assert "activation offloading: a no-op on cpu" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_memory_held_after_forward_falls_and_gradients_stay():
    tokens = torch.randint(0, 512, (8, 64), device="cuda")
    plain = tiny("cuda")
    want = grads(plain, tokens)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = plain(tokens)
    held_plain = torch.cuda.memory_allocated() - base
    del out
    model = tiny("cuda")
    hooks = apply_offload(list(model.layers.values()), torch.device("cuda"))
    assert hooks is not None
    base = torch.cuda.memory_allocated()
    out = model(tokens)
    held = torch.cuda.memory_allocated() - base
    del out
    got = grads(model, tokens)
    print(f"\ndevice bytes held after forward: {held_plain} plain, {held} offloaded")
    assert held < held_plain
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-5, rtol=0), name
