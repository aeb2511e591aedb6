"""bf16 through autocast when FSDP is absent; float16 with dynamic loss scaling."""

import json
import os

import pytest

from conftest import THIN, read_metrics

BF16 = [
    *THIN,
    "--training.mixed_precision_on_cpu",
    "true",
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.steps",
    "4",
    "--checkpoint.enable",
    "false",
]


@pytest.mark.cover("precision:bfloat16")
def test_bf16_autocast_single_process_matches_fsdp_bf16(train, tmp_path):
    # One process has no FSDP, so bf16 comes from torch.autocast; FSDP 2 casts parameters with
    # its MixedPrecisionPolicy. Both compute in bf16 from the same fp32 master weights.
    one, two, fp32 = str(tmp_path / "one"), str(tmp_path / "two"), str(tmp_path / "fp32")
    train(1, *BF16, "--training.local_batch_size", "4", dump=one).check()
    train(2, *BF16, "--training.local_batch_size", "2", dump=two).check()
    train(
        1,
        *THIN,
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "false",
        "--training.local_batch_size",
        "4",
        dump=fp32,
    ).check()
    a, b, c = read_metrics(one), read_metrics(two), read_metrics(fp32)
    assert max(abs(a[s] - b[s]) for s in a) < 2e-2
    assert a[1] != c[1]  # bf16 really ran: it differs from fp32 in the low bits
    assert abs(a[1] - c[1]) < 2e-2


@pytest.mark.cover("precision:float16")
def test_fp16_loss_scaling_skips_overflow_and_recovers(train, tmp_path):
    dump = str(tmp_path / "fp16")
    run = train(
        2,
        *THIN,
        "--training.mixed_precision_on_cpu",
        "true",
        "--training.mixed_precision_param",
        "float16",
        "--training.loss_scale_init",
        str(2.0**22),
        "--training.steps",
        "10",
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.enable",
        "false",
        dump=dump,
    ).check()
    skipped = [
        int(line.split("step ")[1].split()[0])
        for line in run.stdout.splitlines()
        if "skipped: float16 gradients overflowed" in line
    ]
    assert skipped and skipped[0] == 1  # the huge initial scale overflows at once
    assert max(skipped) <= 7  # ... and is halved until the steps go through
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    last = records[-1]
    assert last["step"] == 10 and last["grad_norm"] < 100  # finite: a real update happened
    losses = read_metrics(dump)
    assert losses[10] < losses[1]
