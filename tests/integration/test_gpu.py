"""The trainer on one CUDA GPU (`make gpu-check` runs these; they skip without CUDA).

- fp32 on the GPU (NCCL process group) follows the CPU run of the same seed checkpoint;
- bf16 (autocast on one device) with per-block compile tracks fp32 eager;
- float8 (torchao, real float8 matmuls, not emulation) tracks bf16 for both scaling recipes.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP32 = ["--training.mixed_precision_param", "float32"]
NO_CKPT = ["--checkpoint.enable", "false"]


def test_one_gpu_follows_cpu_from_a_seed_checkpoint(train, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the seed and the reference run on CPU
    seed_dump = str(tmp_path / "seed")
    train(1, "--checkpoint.create_seed_checkpoint", "true", dump=seed_dump).check()
    start = [
        "--training.steps",
        "5",
        "--checkpoint.initial_load_path",
        f"{seed_dump}/checkpoint/step-0",
        "--checkpoint.export_at_end",
        "false",
        *FP32,
    ]
    cpu = train(1, *start).check()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpu = train(1, *start).check()
    assert "nccl" in gpu.stdout and "nccl" not in cpu.stdout
    assert sorted(gpu.losses) == sorted(cpu.losses) == [1, 2, 3, 4, 5]
    # Different kernels (cuBLAS, memory-efficient SDPA) sum in another order: rounding only.
    assert max(abs(gpu.losses[s] - cpu.losses[s]) for s in cpu.losses) < 2e-4


def test_bf16_compile_tracks_fp32(train):
    steps = ["--training.steps", "20", *NO_CKPT]
    fp32 = train(1, *steps, *FP32).check()
    bf16 = train(1, *steps, "--compile.enable", "true").check()
    assert fp32.losses[20] < 0.8 * fp32.losses[1]
    assert abs(bf16.losses[20] - fp32.losses[20]) / fp32.losses[20] < 0.02
    assert bf16.losses[20] != fp32.losses[20]  # it did run in bf16


def test_float8_recipes_track_bf16(train):
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    steps = ["--training.steps", "20", *NO_CKPT]
    bf16 = train(1, *steps).check()
    for recipe in ("tensorwise", "rowwise"):
        fp8 = train(1, *steps, "--float8.enable", "true", "--float8.recipe_name", recipe).check()
        assert abs(fp8.losses[20] - bf16.losses[20]) / bf16.losses[20] < 0.02, recipe
        assert fp8.losses[20] != bf16.losses[20], recipe
