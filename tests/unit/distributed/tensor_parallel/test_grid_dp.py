"""2D / 2.5D / 3D tensor parallel with data parallel outside the grid, on spawned gloo ranks: the
parameters live on the (dp, grid...) mesh and FSDP2 (`fully_shard(..., dp_mesh_dims=...)`)
shards them over dp_shard and replicates them over dp_replicate (HSDP, DDP); each dp rank
trains its share of the batch and the gradients (averaged over dp) equal one process's on the
whole batch, and a DCP checkpoint of the sharded weights loads into the plain model on one
process exactly. CI runs 2D × FSDP on 8 ranks; `make test-parity-full` adds 2.5D × DDP, 3D × FSDP
and 2D × HSDP on 16."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn

FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)
CASES = {  # name: (mode, dp_replicate, dp_shard, tp, depth)
    "2d-fsdp2": ("2d", 1, 2, 4, 1),
    "2.5d-ddp2": ("2.5d", 2, 1, 8, 2),
    "3d-fsdp2": ("3d", 1, 2, 8, 1),
    "2d-hsdp2x2": ("2d", 2, 2, 4, 1),
}


def _dims(mode: str, dp_replicate: int, dp_shard: int, tp: int, depth: int):
    from titanlab.distributed.parallel_dims import ParallelDims
    from titanlab.distributed.tensor_parallel.two_d import grid_side
    from titanlab.distributed.tensor_parallel.three_d import cube_side

    dims = ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1,
        world_size=dp_replicate * dp_shard * tp,
    )  # fmt: skip
    if mode == "3d":
        dims.tp_cube = cube_side(tp) or 0
    else:
        dims.tp_grid, dims.tp_depth = grid_side(tp, depth) or 0, depth
    return dims


def _worker(rank: int, init_file: str, out: str, case: str) -> None:
    import copy
    import dataclasses

    from titanlab.components.loss import cross_entropy_sum
    from titanlab.distributed.init import destroy_distributed
    from titanlab.distributed.parallelize import apply_ddp, apply_fsdp, grid_dp_dims, tp_grid_loss
    from titanlab.distributed.tensor_parallel.two_d import apply_tp_2d
    from titanlab.distributed.tensor_parallel.three_d import apply_tp_3d
    from titanlab.models.llama3 import llama3_flavors
    from titanlab.models.registry import build_model

    mode, dp_replicate, dp_shard, tp, _ = CASES[case]
    dp = dp_replicate * dp_shard
    init_gloo(rank, dp * tp, init_file)
    ok = False
    try:
        dims = _dims(*CASES[case])
        dims.build_mesh("cpu")
        args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512, n_layers=2)
        torch.manual_seed(0)
        ref = build_model(args)
        ref.init_weights()
        model = copy.deepcopy(ref)
        params = dims.mesh("dp_tp_grid")
        if mode == "3d":
            apply_tp_3d(model, dims.mesh("tp_3d"), params)
        else:
            apply_tp_2d(model, dims.mesh("tp_2d"), params)
        fp32 = {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
        if dp_shard > 1:
            apply_fsdp(model, params, cpu_offload=False, pin_memory=False,
                       reshard_after_forward=True, dp_mesh_dims=grid_dp_dims(dims), **fp32)  # fmt: skip
        else:
            apply_ddp(model, params, dp_mesh_dims=grid_dp_dims(dims), **fp32)
        batch = 2 * (tp // (dims.tp_cube or dims.tp_grid))  # each dp rank splits its share
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 512, (dp * batch, 32), generator=g)
        labels = torch.randint(0, 512, (dp * batch, 32), generator=g)
        labels[1, :5] = -100
        want = cross_entropy_sum(ref(tokens), labels)
        want.backward()
        mine = slice(dims.dp_rank() * batch, (dims.dp_rank() + 1) * batch)
        got = tp_grid_loss(cross_entropy_sum, dims)(model(tokens[mine]), labels[mine])
        got.backward()
        total = got.detach().clone()
        torch.distributed.all_reduce(total)  # the dp shares, each counted on every tp rank
        worst, sharded = 0.0, []
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            # dp averages the gradients of its shares: 1/dp of the whole batch's
            worst = max(worst, (dp * p.grad.full_tensor() - p_ref.grad).abs().max().item())
            sharded += [name] if p.to_local().numel() * dp_shard * tp <= p.numel() else []
        # A DCP checkpoint of the sharded weights loads into the plain model on one process
        # unchanged (the shards' global offsets under FSDP's strided placement on the grid).
        import torch.distributed.checkpoint as dcp

        folder = os.path.join(os.path.dirname(out), "dcp")
        dcp.save(model.state_dict(), checkpoint_id=folder)
        torch.distributed.barrier()
        saved = 0.0
        if rank == 0:
            plain = build_model(args)
            state = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
            dcp.load(state, checkpoint_id=folder, no_dist=True)
            saved = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
            with open(out, "w") as f:
                json.dump({"loss": [want.item(), total.item() / tp], "worst": worst,
                           "sharded": sharded, "mesh": list(params.mesh_dim_names),
                           "saved": saved}, f)  # fmt: skip
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize(
    "case",
    [
        "2d-fsdp2",
        pytest.param("2.5d-ddp2", marks=FULL_ONLY),
        pytest.param("3d-fsdp2", marks=FULL_ONLY),
        pytest.param("2d-hsdp2x2", marks=FULL_ONLY),
    ],
)
def test_grid_tensor_parallel_with_data_parallel_trains_like_one_process(tmp_path, case):
    _, dp_replicate, dp_shard, tp, _ = CASES[case]
    out = str(tmp_path / "result.json")
    spawn(_worker, (str(tmp_path / "init"), out, case), nprocs=dp_replicate * dp_shard * tp)
    with open(out) as f:
        r = json.load(f)
    want, got = r["loss"]
    assert abs(got - want) / want < 1e-6 and r["worst"] < 1e-5  # fp32 sums of ~1e3 tokens
    assert r["saved"] == 0.0  # the checkpoint holds exactly the weights, reassembled
    dp_dims = [n for n, k in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)) if k > 1]
    assert r["mesh"][: len(dp_dims)] == dp_dims  # the parameters' (dp..., grid...) mesh
    linear = "layers.0.attention.wq.weight"
    # FSDP / HSDP: every weight split over dp_shard too (1/(dp_shard·tp) of the Linear per
    # rank); DDP: over tp only
    assert (linear in r["sharded"]) == (dp_shard > 1), r["sharded"]
