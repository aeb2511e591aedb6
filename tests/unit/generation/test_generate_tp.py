"""Greedy generation under tensor parallel 2 (2 gloo ranks) equals 1 process, token for token,
for Llama 3, Qwen3 (q/k norms on the local heads) and Qwen3.5 (linear-attention layers on their
local key and value heads, the recurrent state of those heads cached); sampling with a seed
agrees across ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed
from titanlab.generation import SamplingParams, generate
from titanlab.generation.tensor_parallel import apply_generation_tp
from titanlab.models.registry import build_model, get_family, get_flavor

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [12, 13, 14, 15, 16]]


def tiny(family: str):
    hybrid = {"full_attention_interval": 2, "linear_key_heads": 2, "linear_value_heads": 4,
              "linear_key_dim": 8, "linear_value_dim": 12}  # fmt: skip
    args = dataclasses.replace(
        get_flavor(get_family(family), "debugmodel"), dim=64, n_heads=4, n_kv_heads=2,
        vocab_size=97, max_seq_len=64, n_layers=4 if family == "qwen3_5" else 2,
        **(hybrid if family == "qwen3_5" else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model.eval()


def _worker(rank: int, world: int, init_file: str, out_dir: str, family: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh

        model = tiny(family)
        single = generate(model, PROMPTS, 20)
        apply_generation_tp(model, init_device_mesh("cpu", (world,)))
        result = {
            "single": single,
            "tp": generate(model, PROMPTS, 20),
            "sampled": generate(model, PROMPTS, 20, params=SamplingParams(0.8, 30, 0.9), seed=4),
            "local_heads": model.layers["1"].attention.wq.weight.to_local().shape[0]
            // model.layers["1"].attention.head_dim
            // (2 if family == "qwen3_5" else 1),  # Qwen3.5's wq: each head's query and gate
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_5"])
def test_tp2_greedy_equals_one_process(tmp_path, family):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path), family), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["tp"] == r["single"]
        assert r["local_heads"] == 2  # 4 heads split over 2 ranks
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
