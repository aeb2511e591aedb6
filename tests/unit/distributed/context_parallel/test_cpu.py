"""Context parallel on CPU (`titanlab.distributed.context_parallel.cpu`): torch's ring
attention through the CPU flash kernel gives the one-rank causal attention and its gradients on
2 and 4 gloo ranks with both rotate methods, and a torch that lacks one of the private names it
uses is refused with one line (shown by hiding a name in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from titanlab.distributed.context_parallel import cpu as cp_cpu
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed

REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)


def _attention(q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _worker(rank: int, world: int, rotate: str, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import (
            context_parallel_unshard,
            set_rotate_method,
        )
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cp_cpu.install()
        set_rotate_method(rotate)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        tensors = [torch.randn(2, 4, 32, 8) for _ in range(4)]  # q, k, v, grad of the output
        want = _attention(*tensors)
        shards = [t.clone() for t in tensors]
        with (
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
            context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2, 2]),
        ):
            got = _attention(*shards)
        got = context_parallel_unshard(mesh, got, [2, 2, 2, 2])
        if rank == 0:
            torch.save({"want": want, "got": got}, os.path.join(out_dir, "result.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("world, rotate", [(2, "allgather"), (2, "alltoall"), (4, "alltoall")])
def test_ring_attention_equals_one_rank(world, rotate, tmp_path):
    init = str(tmp_path / "init")
    spawn(_worker, (world, rotate, init, str(tmp_path)), world)
    result = torch.load(tmp_path / "result.pt")
    worst = 0.0
    for name, want, got in zip(("output", "dq", "dk", "dv"), result["want"], result["got"]):
        diff = (want - got).abs().max().item()
        assert diff <= 2e-6, (name, diff)
        worst = max(worst, diff)
    print(f"cp{world} {rotate}: worst |Δ| of output, dq, dk, dv against one rank {worst:.3g}")


def test_every_private_name_is_present():
    cp_cpu.check_private_names()  # raises naming the first one missing


HIDE_ONE = """
import importlib, sys
module = importlib.import_module("torch.distributed.tensor.experimental._context_parallel._attention")
del module._templated_ring_attention_backward
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning.layouts import Layout, check_layout
from tools import parity_matrix
config, args = parity_matrix._base_config()
print(check_layout(config, Layout(1, 1, 1, 1, None, 1, cp=2), 8, args, "cpu"))
"""


def test_a_missing_private_name_is_refused_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-c", HIDE_ONE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("parallelism.context_parallel_degree=2 on CPU: torch ")
    assert "_templated_ring_attention_backward" in line and "context_parallel_degree=1" in line
