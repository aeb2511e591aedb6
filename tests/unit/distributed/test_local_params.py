"""`init_model_weights` on CPU ranks: the shards' own initialization runs on their local
tensors (`local_parameters`), and the weights and buffers equal a single-process init."""

import dataclasses
import os

import torch
from torch.distributed.tensor import DTensor

from titanlab.components.builders import build_meta_model, init_model_weights
from titanlab.models.qwen3_moe import qwen3_moe_flavors

ARGS = dataclasses.replace(qwen3_moe_flavors["debugmodel"], n_layers=2, vocab_size=256)


def _init_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The MoE debug model, 2 layers, fully sharded over 2 ranks and materialized empty, then
    `init_model_weights`: its gathered parameters and its buffers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gloo_group import init_gloo
    from titanlab.distributed.init import destroy_distributed

    init_gloo(rank, world, init_file)
    ok = False
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        model = build_meta_model(ARGS)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        init_model_weights([model], ARGS, torch.device("cpu"), seed=3, world_size=2)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # put back
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        torch.save({"params": params, "buffers": buffers}, os.path.join(out_dir, f"{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_sharded_init_equals_one_process_init_buffers_included(tmp_path):
    from gloo_group import spawn

    spawn(_init_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    one = build_meta_model(ARGS)
    one.to_empty(device="cpu")
    init_model_weights([one], ARGS, torch.device("cpu"), seed=3, world_size=1)
    want_params, want_buffers = dict(one.named_parameters()), dict(one.named_buffers())
    assert {"layers.0.feed_forward.tokens_per_expert", "rope_cos"} <= set(want_buffers)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["params"].keys() == want_params.keys()
        for name, p in want_params.items():
            assert torch.equal(got["params"][name], p), name
        assert got["buffers"].keys() == want_buffers.keys()
        for name, b in want_buffers.items():
            assert torch.equal(got["buffers"][name], b), name
