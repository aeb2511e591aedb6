"""Which Linear layers the float8 converter keeps in high precision."""

import pytest
import torch

from titanlab.config.job_config import Float8
from titanlab.precision.float8 import apply_float8
from titanlab.models.llama3 import Transformer, TransformerModelArgs

pytest.importorskip("torchao")


def test_converter_skips_output_and_odd_dims():
    args = TransformerModelArgs(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=24, max_seq_len=16
    )  # ffn hidden 192? not always /16
    model = Transformer(args)
    apply_float8(model, Float8(enable=True, emulate=True), torch.device("cpu"), fsdp_enabled=False)
    kinds = {
        name: type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert kinds["output"] == "Linear"  # filtered by name (and vocab 100 is not /16)
    assert kinds["layers.0.attention.wq"] == "Float8Linear"
    hidden = args.ffn_hidden_dim()
    expected = "Float8Linear" if hidden % 16 == 0 else "Linear"
    assert kinds["layers.0.feed_forward.w1"] == expected


def test_disabled_is_a_no_op():
    args = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128, max_seq_len=16)
    model = Transformer(args)
    apply_float8(model, Float8(enable=False), torch.device("cpu"), fsdp_enabled=False)
    assert all(type(m) is not None and type(m).__name__ != "Float8Linear" for m in model.modules())


def test_float8_tp_styles_come_from_torchao():
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from titanlab.distributed.tensor_parallel.one_d import block_styles

    assert block_styles(True) == (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    assert block_styles(False) == (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
