"""Rollouts with the policy module: the KV-cached decode equals a full recompute, the sampler's
log-probabilities equal the trainer's, and under FSDP the gathered-weights option does one
all-gather per module and leaves every parameter sharded again."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from titanlab.data.digit_tasks import EOS, VOCAB_SIZE, DigitTask
from titanlab.generation.sampling import SamplingParams
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.rollout import gathered_weights, sample_completions

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "distributed")
)
from gloo_group import init_gloo, spawn

N = 5


def tiny(family: str = "llama3"):
    flavor = get_flavor(get_family(family), "debugmodel")
    args = dataclasses.replace(
        flavor, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB_SIZE, max_seq_len=32
    )
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


def prompts(n: int = 6) -> torch.Tensor:
    import random

    task = DigitTask("reverse", 4)
    return torch.tensor([task.draw(random.Random(i), False)[0] for i in range(n)])


def rollout(model, tp_degree: int, temperature: float = 1.0):
    gen = torch.Generator().manual_seed(3)
    return sample_completions(model, prompts(), N, SamplingParams(temperature), gen, EOS, tp_degree)


def trainer_logp(model, r, temperature: float = 1.0) -> torch.Tensor:
    seq = torch.cat([r.prompts, r.completions], dim=1)
    logits = model(seq[:, :-1])
    start = seq.shape[1] - N - 1
    return obj.token_logprobs(logits[:, start:], seq[:, 1:][:, start:], temperature)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_cached_decode_equals_recompute_and_sampler_logprobs_equal_the_trainers(family):
    model = tiny(family)
    with torch.no_grad():
        cached, recomputed = rollout(model, 1, 0.7), rollout(model, 2, 0.7)
        logp = trainer_logp(model, cached, 0.7)
    assert torch.equal(cached.completions, recomputed.completions)
    assert torch.allclose(cached.sampler_logp, recomputed.sampler_logp, atol=1e-5)
    mask, _ = obj.completion_mask(cached.completions, EOS)
    gap = torch.where(mask, (logp - cached.sampler_logp).abs(), 0.0).max().item()
    assert gap < 1e-5, gap
    # after a sequence's first EOS: EOS, and no log-probability
    assert torch.all(torch.where(mask, 0, cached.completions - EOS) == 0)
    assert torch.all(torch.where(mask, 0.0, cached.sampler_logp) == 0)


@pytest.mark.parametrize("tp_degree", [1, 2])
def test_prompts_of_different_lengths_sample_as_alone_and_score_the_same_in_the_trainer(
    tp_degree,
):
    """A batch of prompts of 5, 7 and 8 tokens (left-padded for the KV cache, packed left for
    the recompute) gives each prompt the greedy completion it gets alone, and the trainer's
    forward of the packed sequences gives the sampler's log-probabilities."""
    import random

    from titanlab.posttrain.rl.logprobs import sequence_logprobs
    from titanlab.posttrain.rl.rollout import left_pad

    model = tiny()
    ids = [DigitTask("reverse", d).draw(random.Random(d), False)[0] for d in (3, 5, 6, 5)]
    alone = []
    with torch.no_grad():
        for p in ids:
            gen = torch.Generator().manual_seed(0)
            r = sample_completions(model, torch.tensor([p]), N, SamplingParams(0.0), gen, EOS)
            alone.append(r.completions[0])
        padded, lens = left_pad(ids, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        batch = sample_completions(model, padded, N, SamplingParams(0.0), gen, [EOS, 14],
                                   tp_degree, lens)  # fmt: skip
        logp = batch.completion_columns(sequence_logprobs(model, batch.sequences(), 1.0))
    assert padded.shape == (4, 8) and lens.tolist() == [5, 7, 8, 7]
    assert torch.equal(batch.completions, torch.stack(alone))
    assert batch.sequences()[0, :5].tolist() == ids[0]
    mask, _ = obj.completion_mask(batch.completions, [EOS, 14])
    gap = torch.where(mask, (logp - batch.sampler_logp).abs(), 0.0).max().item()
    assert gap < 1e-5, gap


def _fsdp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import DTensor

        from titanlab.distributed.comm_counter import CommCounter
        from titanlab.distributed.init import destroy_distributed

        model = tiny()
        reference = rollout(model, 1)
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        counts, sharded = {}, False
        for keep in (True, False):
            with CommCounter() as c, gathered_weights(model, keep):
                r = rollout(model, 1)
            counts[str(keep)] = c.summary()["all_gather"]["calls"]
            assert torch.equal(r.completions, reference.completions)
            if keep:  # every module resharded after the rollout
                sharded = all(isinstance(p, DTensor) for p in model.parameters())
        trainer_logp(model, r).sum().backward()  # a training step after the rollout
        grads = all(isinstance(p.grad, DTensor) for p in model.parameters())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"counts": counts, "modules": len(modules), "sharded": sharded,
                       "grads": grads}, f)  # fmt: skip
        ok = True
    finally:
        from titanlab.distributed.init import destroy_distributed

        destroy_distributed(barrier=ok)


def test_keeping_weights_gathered_all_gathers_once_per_module_and_reshards_every_module(tmp_path):
    spawn(_fsdp_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["counts"]["True"] == got["modules"] == 3  # 2 blocks + the root
        # without: every module per forward (the prefill and 4 decode steps)
        assert got["counts"]["False"] == got["modules"] * N
        assert got["sharded"] and got["grads"]
