"""Expert weights sharded by FSDP2 over their expert-FSDP ranks: on a dim that splits evenly
(`expert_shard_dim`), so a rank with fewer local experts than efsdp ranks holds its even share,
not a whole padded expert; and such a layer trains like the unsplit one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gloo_group import init_gloo, spawn
from titanlab.distributed.expert_sharding import expert_shard_dim, held_elements
from titanlab.distributed.init import destroy_distributed
from titanlab.models.common.moe import MoE, MoEArgs

DIM, EXPERTS = 16, 2


@pytest.mark.parametrize(
    ("shape", "ranks", "dim", "held"),
    [
        ((4, 64, 32), 2, 0, 2 * 64 * 32),  # the local experts split evenly: dim 0
        ((8, 4096, 1536), 16, 1, 8 * 256 * 1536),  # 235B at EP 16 on 256: 8 experts, 16 ranks
        ((1, 12, 16), 2, 1, 6 * 16),  # 1 local expert over 2 ranks
        ((1, 16), 4, 1, 4),  # a bias
        ((3, 5, 7), 2, 0, 2 * 5 * 7),  # nothing splits evenly: dim 0, padded to 2 experts
    ],
)
def test_the_shard_dim_splits_evenly_where_a_dim_can(shape, ranks, dim, held):
    assert expert_shard_dim(shape, ranks) == dim
    assert held_elements(shape, ranks) == held


def _layer() -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=1, hidden_dim=12))
    moe.init_weights(0.05)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
    return moe


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """EP 2 × efsdp 2 on 4 ranks: 1 local expert per EP rank, sharded over 2 efsdp ranks."""
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from titanlab.distributed.expert_parallel import apply_ep
        from titanlab.distributed.expert_sharding import shard_placement

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        reference, sharded = _layer(), _layer()
        apply_ep(sharded, mesh["ep"])
        fully_shard(sharded.experts, mesh=mesh["efsdp"], shard_placement_fn=shard_placement(2))
        sharded.experts.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        sharded.experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        held = {n: p.to_local().numel() for n, p in sharded.experts.named_parameters()}
        torch.manual_seed(100 + rank)  # each rank its own tokens
        x = torch.randn(1, 6 + 2 * rank, DIM)
        results: dict = {"held": held}
        for name, moe in (("reference", reference), ("sharded", sharded)):
            opt = torch.optim.AdamW(moe.parameters(), lr=1e-2, foreach=False)
            out = moe(x)
            out.square().sum().backward()
            for n, p in moe.named_parameters():
                if n.startswith("experts.") and name == "sharded":
                    continue  # reduce-scattered (summed) by FSDP
                dist.all_reduce(p.grad)  # the unsplit layer's gradient of all ranks' tokens
            opt.step()
            results[name] = {"out": out.detach()}
            for n, p in moe.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                results[name][n] = full.detach().clone()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_one_local_expert_over_two_efsdp_ranks_holds_half_and_trains_like_the_unsplit_layer(
    tmp_path,
):
    spawn(_worker, (4, str(tmp_path / "init"), str(tmp_path)), 4)
    full = {n: p.numel() for n, p in _layer().experts.named_parameters()}
    worst = 0.0
    for rank in range(4):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # each rank holds a quarter of every expert weight (2 experts over ep 2 × efsdp 2)
        assert r["held"] == {n: numel // 4 for n, numel in full.items()}, rank
        ref, got = r["reference"], r["sharded"]
        assert ref.keys() == got.keys()
        for key in ref:  # the output, then every weight after one AdamW step
            assert torch.allclose(got[key], ref[key], atol=1e-5, rtol=0), (rank, key)
            worst = max(worst, (got[key] - ref[key]).abs().max().item())
    print(f"1 local expert over 2 efsdp ranks: worst |Δ| against the unsplit layer {worst:.3g}")
