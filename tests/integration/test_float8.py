"""float8 training (torchao, emulate mode on CPU) tracks bf16 training of the debug model."""

import pytest

from conftest import THIN, full_only, read_metrics

BF16 = [
    *THIN,
    "--optimizer.lr",
    "1e-2",  # the thin flavor's loss falls 10 % in 20 steps
    "--training.steps",
    "20",
    "--training.mixed_precision_on_cpu",
    "true",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "false",
]


@pytest.mark.cover("precision:float8")
@full_only("CI: float8 in the feature-pair matrix's rows, against one eager process")
def test_float8_emulate_loss_within_2_percent_of_bf16(train, tmp_path):
    bf16, fp8 = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    train(2, *BF16, dump=bf16).check()
    train(2, *BF16, "--float8.enable", "true", "--float8.emulate", "true", dump=fp8).check()
    a, b = read_metrics(bf16), read_metrics(fp8)
    assert a[20] < 0.9 * a[1]  # both trained
    assert abs(b[20] - a[20]) / a[20] < 0.02, (a[20], b[20])
    assert a[20] != b[20]  # and float8 really ran (the numerics differ)


def test_float8_without_emulate_on_cpu_is_one_line(train):
    run = train(1, "--training.steps", "1", "--float8.enable", "true")
    assert run.returncode != 0
    assert (
        "titanlab: error: float8.enable=true needs a GPU with float8 (compute capability >= "
        "8.9), not cpu; set float8.emulate=true to test the numerics"
    ) in run.stderr
