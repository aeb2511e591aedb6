"""`clip_grad_norm_` on CPU: the norm accumulates in float64, so it does not depend on how a
gradient is split into shards (torch 2.13's float32 CPU norm of a constant (4352, 64) tensor is
1.5e-5 off; FSDP's halves were off by a different amount, which made the clipped update depend
on the layout). On 2 gloo ranks, the expert-parallel experts' norm is one all_reduce over the
flattened expert mesh, equal to the single-process norm."""

import logging

import torch

from titanlab.distributed.utils import clip_grad_norm_


def _params(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_norm_is_the_float64_norm_however_the_gradient_is_split():
    g = torch.full((4352, 64), 1e-3)
    exact = g.double().norm().item()
    assert abs(g.norm().item() / exact - 1) > 1e-5  # the float32 norm this guards against
    whole = clip_grad_norm_(_params(g), max_norm=0).item()
    halves = clip_grad_norm_(_params(g[:2176], g[2176:]), max_norm=0).item()
    assert whole == halves
    assert abs(whole / exact - 1) < 1e-7


def test_clipping_scales_to_max_norm():
    params = _params(torch.full((100,), 3.0), torch.full((10, 10), 4.0))
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert abs(norm.item() - 50.0) < 1e-5 and norm.dtype == torch.float32
    clipped = torch.cat([p.grad.flatten() for p in params]).double().norm().item()
    assert abs(clipped - 1.0) < 1e-5


def test_a_large_gradient_norm_is_float64_accurate_without_a_float64_copy():
    g = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = g.double().norm().item()
    assert abs(g.norm().item() / exact - 1) > 1e-6  # float32's error at 16 M terms
    got = clip_grad_norm_(_params(g), max_norm=0).item()
    assert got == torch.tensor(exact, dtype=torch.float32).item()


def test_every_shape_gives_the_float64_norm_rounded_to_float32():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen) for s in ((64, 3000), (3000, 64), (4, 5, 600), (700,))]
    exact = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    got = clip_grad_norm_(_params(*grads), max_norm=0).item()
    assert got == torch.tensor(exact, dtype=torch.float32).item()


class _Lines(logging.Handler):
    """The messages of the log records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _expert_norm_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """EP 2 × FSDP on `world` ranks (efsdp of 1 rank): the MoE experts as the trainer shards
    them, one backward on this rank's tokens, then the gradient norm, its log lines and
    collectives; and the full gradients for the single-process norm."""
    import os

    from torch.distributed.fsdp import fully_shard

    from gloo_group import init_gloo
    from titanlab.distributed.comm_counter import CommCounter
    from titanlab.distributed.expert_parallel import apply_ep
    from titanlab.distributed.init import destroy_distributed
    from titanlab.distributed.parallel_dims import ParallelDims
    from titanlab.distributed.expert_sharding import expert_fsdp
    from titanlab.models.common.moe import MoE, MoEArgs

    init_gloo(rank, world, init_file)
    ok = False
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=world, ep=2)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        moe = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=12))
        moe.init_weights(0.5)
        ep_mesh = dims.mesh("ep")
        sharding = expert_fsdp(dims, torch.device("cpu"))
        assert ep_mesh is not None and sharding is not None
        apply_ep(moe, ep_mesh)
        fully_shard(moe.experts, mesh=sharding.mesh)
        torch.manual_seed(1 + rank)
        moe(torch.randn(1, 8, 16)).square().sum().backward()
        experts = [moe.experts.w1, moe.experts.w2, moe.experts.w3]
        assert experts[0].grad.device_mesh.mesh_dim_names == ("efsdp", "dp_shard_in_ep")
        logs = _Lines()
        logger = logging.getLogger("torch.distributed.tensor._redistribute")
        logger.addHandler(logs)
        with CommCounter() as counter:
            norm = clip_grad_norm_(experts, max_norm=0)
        logger.removeHandler(logs)
        full = [p.grad.full_tensor() for p in experts]
        torch.save({"norm": norm, "full": full, "logs": logs.lines, "comms": counter.summary()},
                   os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_expert_gradient_norm_is_one_all_reduce_over_the_flattened_expert_mesh(tmp_path):
    """The expert weights' gradients live on the 2-D (efsdp, dp_shard_in_ep) mesh; their norm is
    partial over both dims. With the flattened `efsdp_ep` mesh DTensor reduces it in one
    all_reduce, without torch's warning of "2 sequential all_reduce operations", and the norm is
    the single-process norm of the same (gathered) gradients."""
    from gloo_group import spawn

    spawn(_expert_norm_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one_process = clip_grad_norm_(_params(*results[0]["full"]), max_norm=0).item()
    assert 20 < one_process < 30  # 24.81164 (float64 24.8116437)
    for r in results:
        # Both sides sum the same float32 row norms in float64 and round once to float32: equal
        # here; 1e-6 relative (8 float32 ulps) leaves room only for the order of the float64 sum.
        assert abs(r["norm"].item() / one_process - 1) < 1e-6
        assert not [m for m in r["logs"] if "sequential all_reduce" in m], r["logs"]
        # One all_reduce of the 3 weights' float64 norms (8 bytes each) over both ranks. (Without
        # efsdp_ep it was one too, DTensor skipping the 1-rank efsdp dim, but it warned of two;
        # with efsdp > 1, `dp_shard` is already that flattened mesh.)
        assert r["comms"] == {
            "all_reduce": {"calls": 1, "bytes": 24, "wire_bytes": 24, "sizes": {"24x2": 1}}
        }


def _clip_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Gradients that are DTensors on a 2-D (dp, tp) mesh of 2 ranks (Shard, Replicate and
    Partial placements, float32 and bfloat16) clipped by `clip_grad_norm_`, and the same
    gradients clipped by torch's `clip_grads_with_norm_` through DTensor's own foreach op."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from gloo_group import init_gloo
    from titanlab.distributed.init import destroy_distributed

    init_gloo(rank, world, init_file)
    ok = False
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(rank)  # Partial and uneven parts differ per rank
        specs = [
            ((8, 6), torch.float32, (Shard(0), Shard(1))),
            ((3 - rank, 4), torch.float32, (Replicate(), Shard(0))),  # uneven: 3 + 2 of 5 rows
            ((7,), torch.bfloat16, (Replicate(), Replicate())),
            ((3, 4), torch.float32, (Shard(0), Partial())),
        ]
        ours, theirs = [], []
        for i, (shape, dtype, placements) in enumerate(specs):
            local = torch.randn(shape, dtype=dtype) * 3
            for out in (ours, theirs):
                uneven = {"shape": (5, 4), "stride": (4, 1)} if i == 1 else {}
                grad = DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                                          **uneven)  # fmt: skip
                p = torch.nn.Parameter(torch.zeros_like(grad))
                p.grad = grad
                out.append(p)
        norm = clip_grad_norm_(ours, max_norm=0.5)
        torch.nn.utils.clip_grads_with_norm_(theirs, 0.5, norm, foreach=True)
        torch.save(
            {"norm": norm, "ours": [p.grad.to_local() for p in ours],
             "theirs": [p.grad.to_local() for p in theirs]},
            os.path.join(out_dir, f"clip{rank}.pt"),
        )  # fmt: skip
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_clipping_dtensor_gradients_gives_torchs_bits_under_every_placement(tmp_path):
    """`clip_grad_norm_` scales each DTensor gradient through its local shard (skipping
    DTensor's sharding propagation of the foreach op); the shards it leaves are bit for bit
    those of torch's `clip_grads_with_norm_` on the DTensors, for Shard, uneven Shard,
    Replicate and Partial placements, in float32 and bfloat16, and the norm is large enough
    that the gradients really are scaled."""
    from gloo_group import spawn

    spawn(_clip_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"clip{rank}.pt")
        assert got["norm"].item() > 5  # clipped by a factor of more than 10
        for ours, theirs in zip(got["ours"], got["theirs"], strict=True):
            assert ours.dtype == theirs.dtype
            assert torch.equal(ours, theirs)
