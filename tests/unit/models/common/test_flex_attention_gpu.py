"""On a CUDA GPU, masked attention runs FlexAttention (compiled) under the block masks of
`flex_masks`, and each path's forward and backward equal the SDPA path's (dense masks, the
chunked sliding window, the sink as an extra key) within bf16 tolerance: GQA with a window,
sinks, both, each with and without documents; MLA with documents; and context parallel's
flex paths (ring allgather, ring alltoall, Ulysses) on 2 GPUs against one. Skipped without CUDA
(the CPU tests, `test_flex_attention.py` and `context_parallel/test_attention_kernels.py`, check
the forward and the ring's backward algebra)."""

from __future__ import annotations

import os

import pytest
import torch

from titanlab.models.common.attention import Attention
from titanlab.models.common.document_mask import block_causal_mask
from titanlab.models.common.flex_kernel import flex_attend
from titanlab.models.common.flex_masks import band_block_mask, document_block_mask
from titanlab.models.common.mla import MLAttention
from titanlab.models.common.rope import precompute_rope_cos_sin
from tests.unit.models.common.test_flex_masks import random_documents, restarted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SEQ = 1000  # not a multiple of the 128-token tile


def _run(module, x, cos, sin, mask):
    x = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = module(x, cos, sin, mask=mask)
    (grad,) = torch.autograd.grad(out.float().square().sum(), x)
    return out.float(), grad


def _inputs(documents: bool, head_dim: int, dim: int):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, SEQ, dim, generator=gen).cuda()
    cos, sin = precompute_rope_cos_sin(head_dim, SEQ, 10000.0, None, device="cuda")
    if not documents:
        return x, cos, sin, None, None
    segments = random_documents(gen, 2, SEQ).cuda()
    positions = restarted(segments.cpu()).cuda()
    return x, cos[positions], sin[positions], segments, positions


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_gqa_forward_and_backward_equal_sdpa(window, sinks, documents):
    if window is None and not sinks and not documents:
        pytest.skip("plain causal attention runs SDPA on every device")
    torch.manual_seed(0)
    attn = Attention(512, 8, 2, 64, None, sinks=sinks, window=window).cuda()
    attn.init_weights(0.02)
    x, cos, sin, segments, positions = _inputs(documents, 64, 512)
    if documents:
        flex_mask = document_block_mask(segments, positions, segments, positions, window)
        dense = block_causal_mask(segments)
    else:
        flex_mask, dense = band_block_mask(SEQ, SEQ, window, x.device), None
    out_flex, grad_flex = _run(attn, x, cos, sin, flex_mask)
    out_sdpa, grad_sdpa = _run(attn, x, cos, sin, dense)
    torch.testing.assert_close(out_flex, out_sdpa, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grad_flex, grad_sdpa, atol=5e-2, rtol=5e-2)


def test_mla_with_documents_forward_and_backward_equal_sdpa():
    torch.manual_seed(0)
    mla = MLAttention(512, 8, 0, 128, 64, 32, 64, 96**-0.5).cuda()
    mla.init_weights(0.02)
    x, cos, sin, segments, positions = _inputs(True, 32, 512)
    mask = document_block_mask(segments, positions, segments, positions)
    out_flex, grad_flex = _run(mla, x, cos, sin, mask)
    out_sdpa, grad_sdpa = _run(mla, x, cos, sin, block_causal_mask(segments))
    torch.testing.assert_close(out_flex, out_sdpa, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grad_flex, grad_sdpa, atol=5e-2, rtol=5e-2)


def _cp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from titanlab.distributed.context_parallel import documents as cp_documents
    from titanlab.distributed.context_parallel.balance import shard_order

    from titanlab.distributed.init import destroy_distributed

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    ok = False
    try:
        gen = torch.Generator().manual_seed(2)
        q, k, v, grad = (torch.randn(1, 8, 2048, 64, generator=gen) for _ in range(4))
        sinks = torch.randn(8, generator=gen)
        segments = random_documents(gen, 1, 2048)
        positions = restarted(segments)
        order = shard_order(segments, 2048, 1, world, "work")
        mine = order[:, rank * 2048 // world : (rank + 1) * 2048 // world]
        rows = mine[:, None, :, None].expand(-1, 8, -1, 64)
        results = {}
        for mode, rotate in (("ring", "allgather"), ("ring", "alltoall"), ("ulysses", "allgather")):
            attention = cp_documents.ContextParallelAttention(
                segments.gather(1, mine).cuda(), positions.gather(1, mine).cuda(),
                dist.group.WORLD, mode, rotate,
            )  # fmt: skip
            local = [t.gather(2, rows).cuda().bfloat16().requires_grad_() for t in (q, k, v)]
            s = sinks.cuda().requires_grad_()
            out = attention.attend(*local, window=300, sinks=s)
            out.backward(grad.gather(2, rows).cuda().bfloat16())
            results[mode, rotate] = [t.float().cpu() for t in (out, *[t.grad for t in local])]
            results[mode, rotate].append(s.grad.cpu())
        torch.save({"results": results, "rows": mine}, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_flex_paths_on_two_gpus_equal_one(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_cp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    gen = torch.Generator().manual_seed(2)
    q, k, v, grad = (torch.randn(1, 8, 2048, 64, generator=gen) for _ in range(4))
    sinks = torch.randn(8, generator=gen)
    segments = random_documents(gen, 1, 2048)
    positions = restarted(segments).cuda()
    segments = segments.cuda()
    tq, tk, tv = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
    s = sinks.cuda().requires_grad_()
    mask = document_block_mask(segments, positions, segments, positions, 300)
    want = flex_attend(tq, tk, tv, mask, sinks=s, window=300)
    want.backward(grad.cuda().bfloat16())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in ranks[0]["results"]:
        for r in ranks:
            rows = r["rows"][:, None, :, None].expand(-1, 8, -1, 64)
            got = r["results"][key]
            for a, b in zip(got[:4], (want, tq.grad, tk.grad, tv.grad)):
                torch.testing.assert_close(a, b.float().cpu().gather(2, rows), atol=3e-2,
                                           rtol=3e-2, msg=str(key))  # fmt: skip
        summed = sum(r["results"][key][4] for r in ranks)
        torch.testing.assert_close(summed, s.grad.cpu(), atol=5e-2, rtol=5e-2, msg=str(key))
