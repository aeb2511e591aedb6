"""tools/ledger_calibration.py without a ledger build: `fit` derives each factor a row names
from its profiled ms (work ÷ (seconds × peak)) and no other, every factor is fitted by one row,
the FA2 row runs with cuDNN's SDPA off, and the table states each row's use and sums up the
fit rows' (in sample) and the check rows' (out of sample) errors apart."""

import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
from titanlab.config.device_path import Target
from titanlab.ledger.gpu_kernels import sdpa_kernel
from titanlab.ledger.record import OpRecord
from titanlab.planning.cluster import get_profile
from tools import ledger_calibration as lc

H100 = get_profile("h100")
ATTENTION_FLOPS = 7e13
OPTIMIZER_BYTES = 4e10


def attention_op() -> OpRecord:
    return OpRecord("aten._scaled_dot_product_flash_attention.default", "layers.0", "forward",
                    "attention", flops=int(ATTENTION_FLOPS), dtype="bfloat16")  # fmt: skip


def optimizer_op() -> OpRecord:
    half = int(OPTIMIZER_BYTES / 2)
    return OpRecord("aten._fused_adamw_.default", "", "optimizer", "other", bytes_read=half,
                    bytes_written=half, dtype="float32")  # fmt: skip


def fa2_row(**over) -> lc.Row:
    fields = dict(name="FA2", device="h100", measured_s=0.363, source="H100 2026-11-23",
                  profile_ms=(("attention", 80), ("optimizer", 53), ("fused", 32)),
                  fits=("attention_flash",))  # fmt: skip
    return lc.Row(**{**fields, **over})


def test_a_row_fitting_attention_flash_gives_its_attention_flops_over_ms_times_peak():
    fitted = lc.fit({fa2_row(): [attention_op(), optimizer_op()]})
    assert fitted == {
        "attention_flash": pytest.approx(ATTENTION_FLOPS / (0.080 * H100.flops("bfloat16")))
    }  # the row's optimizer and fused ms are not used: memory and fused are not its factors


def test_a_row_fits_each_factor_it_names_from_its_own_kind():
    row = fa2_row(fits=("memory", "attention"))
    fitted = lc.fit({row: [attention_op(), optimizer_op()]})
    assert fitted == {
        "memory": pytest.approx(OPTIMIZER_BYTES / (0.053 * H100.memory_bandwidth)),
        "attention": pytest.approx(ATTENTION_FLOPS / (0.080 * H100.flops("bfloat16"))),
    }


def test_float8_fits_on_the_gemm_time_less_the_bf16_gemms():
    f8, bf16 = 3e14, 2e13
    ops = [
        OpRecord("aten._scaled_mm.default", "layers.0.w1", "forward", "gemm", flops=int(f8),
                 dtype="float8_e4m3fn"),
        OpRecord("aten.mm.default", "output", "forward", "gemm", flops=int(bf16),
                 dtype="bfloat16"),
    ]  # fmt: skip
    row = lc.Row("float8", "h100", 0.3, "", profile_ms=(("gemm", 162),),
                 fits=("float8_tensorwise",))  # fmt: skip
    bf16_s = bf16 / (H100.flops("bfloat16") * H100.efficiency.matmul)
    assert lc.fit({row: ops}) == {
        "float8_tensorwise": pytest.approx(f8 / ((0.162 - bf16_s) * H100.flops("float8")))
    }


def test_check_rows_fit_nothing_and_an_unknown_factor_is_refused():
    assert lc.fit({fa2_row(fits=()): [attention_op()]}) == {}
    with pytest.raises(ValueError, match="attention_fa3"):
        lc.fit({fa2_row(fits=("attention_fa3",)): [attention_op()]})


def test_every_factor_is_fitted_by_one_row_and_the_fa2_row_runs_without_cudnn():
    fitted = [name for row in lc.ROWS for name in row.fits]
    assert sorted(fitted) == sorted(lc.FACTORS)  # none fitted twice, none left out
    (fa2,) = [row for row in lc.ROWS if "attention_flash" in row.fits]
    assert not fa2.cudnn_sdp and dict(fa2.profile_ms)["attention"] == 80
    assert all(row.profile_ms for row in lc.ROWS if row.fits)


def test_the_cudnn_context_makes_the_ledger_take_flash_attention_and_restores_the_flag():
    q = torch.empty(1, 2, 16, 64, device="meta")
    hopper = Target("cuda", (9, 0))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with lc.cudnn_sdp(False):
        assert sdpa_kernel(hopper, q, q, masked=False) == "flash"
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_the_table_states_each_rows_use_and_sums_up_fit_and_check_rows_apart():
    rows = [
        (fa2_row(name="fit A", measured_s=1.0), 1.10),
        (fa2_row(name="fit B", measured_s=1.0, fits=("memory", "fused")), 0.98),
        (fa2_row(name="check A", measured_s=2.0, fits=()), 2.10),
        (fa2_row(name="check B", measured_s=1.0, fits=()), 0.80),
        (fa2_row(name="Liger", measured_s=1.0, fits=(), not_predicted="Triton"), None),
    ]
    lines = lc.table(rows).splitlines()
    by_name = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    assert "| fit: attention_flash | 1.000 | 1.100 | +10.0% |" in by_name["fit A"]
    assert "| fit: memory, fused |" in by_name["fit B"]
    assert "| check | 2.000 | 2.100 | +5.0% |" in by_name["check A"]
    assert by_name["Liger"].endswith("| not predicted | 1.000 | - | Triton |")
    assert "In sample (fit rows), 2: max |error| 10.0%, mean |error| 6.0%." in lines
    assert "Out of sample (check rows), 2: max |error| 20.0%, mean |error| 12.5%." in lines
