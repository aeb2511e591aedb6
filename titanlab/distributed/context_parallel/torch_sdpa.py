"""Context parallel: each sample's sequence is split over the cp ranks and attention exchanges
keys/values between them (ring attention, Liu et al. 2023), through PyTorch's experimental
`context_parallel` on SDPA. The sequence is split load-balanced (head-tail chunks) so causal
attention costs the same on every rank. On CPU the ring runs the CPU flash kernel through
`titanlab.distributed.context_parallel.cpu`, which supplies what torch 2.13 lacks for it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from titanlab.models.common.decoder import Decoder


def cp_context(
    cp_mesh: DeviceMesh | None,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    model_parts: list[nn.Module],
    rotate_method: str = "allgather",
):
    """A context inside which `inputs`/`labels` (bs, seq) and every part's RoPE tables
    (seq, head_dim/2) hold only this rank's share of the sequence; a no-op without cp.
    `rotate_method`: allgather or alltoall (how key/value shards travel round the ring)."""
    if cp_mesh is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    if inputs.device.type == "cpu":
        from titanlab.distributed.context_parallel import cpu as cp_cpu

        cp_cpu.install()
    set_rotate_method(rotate_method)

    buffers, dims = [inputs, labels], [1, 1]
    for part in model_parts:
        model = cast("Decoder", part)  # every part is a Decoder (or a stage of one)
        buffers += [model.rope_cos, model.rope_sin]
        dims += [0, 0]
    stack = contextlib.ExitStack()
    stack.enter_context(
        sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        )
    )
    stack.enter_context(
        context_parallel(
            cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={inputs, labels}
        )
    )
    return stack
