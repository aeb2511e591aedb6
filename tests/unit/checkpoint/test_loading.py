"""A run that loads every weight from a checkpoint skips drawing them
(`CheckpointLoading.loads_every_weight`, `init_model_weights(weights_loaded=True)`): on 2 FSDP
gloo ranks it ends with the same weights and the same random generator state as a run that drew
them first; a folder without a checkpoint, or one lacking a weight, leaves the weights drawn."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from titanlab.distributed.init import destroy_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))
from gloo_group import init_gloo, spawn

SEED = 7


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlab.components.builders import build_meta_model
    from titanlab.models.llama3 import llama3_flavors

    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, dim=64, n_heads=4,
                               n_kv_heads=2, vocab_size=256)  # fmt: skip
    model = build_meta_model(args)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # what to_empty left: any value a skipped draw would leave behind
    return model, args


def _checkpointer(model, dump: str, initial_load_path: str = ""):
    from titanlab.checkpoint import Checkpointer
    from titanlab.config.job_config import Checkpoint

    cfg = Checkpoint(enable=True, initial_load_path=initial_load_path)
    return Checkpointer(cfg, dump, model_parts=[model], optimizer=None, lr_scheduler=None,
                        dataloader=None, dp_rank=0)  # fmt: skip


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in sd.items()}


def _worker(rank: int, world: int, init_file: str, root: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        import torch.distributed.checkpoint as dcp

        from titanlab.components.builders import init_model_weights

        device = torch.device("cpu")
        drawn, args = _sharded_model()
        nothing = _checkpointer(drawn, os.path.join(root, "fresh"))
        result = {"nothing_to_load": nothing.loads_every_weight()}
        init_model_weights([drawn], args, device, SEED, world)
        rng_drawn = torch.get_rng_state()
        seed = nothing.save_model_only(0)
        want = _full(drawn)

        # A seed checkpoint lacking one weight leaves the weights to be drawn.
        partial = os.path.join(root, "partial")
        held = {k: v for k, v in nothing._model_sd().items() if k != "norm.weight"}
        dcp.save({"model": held, "train_state": {"step": 0}}, checkpoint_id=partial)
        lacking, _ = _sharded_model()
        result["lacking_one"] = _checkpointer(
            lacking, os.path.join(root, "b"), partial
        ).loads_every_weight()

        loaded, _ = _sharded_model()
        ckpt = _checkpointer(loaded, os.path.join(root, "c"), seed)
        result["seed_holds_all"] = ckpt.loads_every_weight()
        init_model_weights([loaded], args, device, SEED, world, weights_loaded=True)
        result["same_rng"] = torch.equal(torch.get_rng_state(), rng_drawn)
        local = dict(loaded.named_parameters())["layers.0.attention.wq.weight"].to_local()
        result["nothing_drawn"] = bool((local == 7).all())
        result["norm_set"] = bool(
            (dict(loaded.named_parameters())["norm.weight"].to_local() == 1).all()
        )
        ckpt.load()
        got = _full(loaded)
        result["same_weights"] = sorted(got) == sorted(want) and all(
            torch.equal(got[k], want[k]) for k in want
        )
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_loaded_weights_are_not_drawn_and_the_run_starts_alike(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "nothing_to_load": False,
            "lacking_one": False,
            "seed_holds_all": True,
            "same_rng": True,
            "nothing_drawn": True,
            "norm_set": True,
            "same_weights": True,
        }, (rank, result)
