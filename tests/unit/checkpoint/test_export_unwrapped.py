"""An export stores plain tensors: torchao's float8 FSDP weight wrapper keeps its class through
`.to` of the same dtype, and DCP stored the wrapper, which the converter's `weights_only` load
refused (found by the feature-pair row gpt-oss × CP 2 × float8, fp32 export); `unwrapped` gives
its values as a plain tensor, and a tensor or DTensor without a wrapper back unchanged."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from titanlab.checkpoint.manager import unwrapped


def test_the_float8_weight_is_stored_as_a_plain_tensor_and_loads_weights_only(tmp_path):
    values = torch.randn(8, 4)
    mm_config = LinearMMConfig()
    wrapped = WeightWithDynamicFloat8CastTensor(values.clone(), mm_config, torch.float8_e4m3fn)
    assert type(wrapped.to(torch.float32)) is WeightWithDynamicFloat8CastTensor  # the trap
    plain = unwrapped(wrapped.to(torch.float32))
    assert type(plain) is torch.Tensor and torch.equal(plain, values)
    dcp.save({"w": plain}, checkpoint_id=str(tmp_path))
    back = {"w": torch.empty(8, 4)}
    dcp.load(back, checkpoint_id=str(tmp_path))  # DCP reads tensors without unpickling a class
    assert torch.equal(back["w"], values)
    loose = torch.randn(3)
    assert unwrapped(loose) is loose
