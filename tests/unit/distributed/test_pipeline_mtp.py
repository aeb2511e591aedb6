"""Multi-token prediction across pipeline stages, in one process: the split puts the depths on
the last stage, every boundary carries the rolled tokens' embeddings beside the hidden state,
and the stages chained by hand give the whole model's logits, MTP loss and every gradient (the
embedding's from both of its uses); the cost split counts the depths on the last stage."""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlab.distributed import pipeline
from titanlab.distributed.pipeline_split import unit_costs
from titanlab.models.common.mtp import mtp_targets
from titanlab.models.deepseek_v3 import deepseek_v3_flavors
from titanlab.models.registry import build_model

ARGS = dataclasses.replace(
    deepseek_v3_flavors["debugmodel"], vocab_size=97, max_seq_len=32, n_layers=3
)
STAGES = [
    ["tok_embeddings", "layers.0"],
    ["layers.1"],
    ["layers.2", "norm", "output"],
]


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@pytest.mark.parametrize(
    "mtp_loss_weight,depths", [(0.3, 1), (0.3, 2), (0.0, 1)], ids=["D1", "D2", "untrained"]
)
def test_stages_chained_equal_the_whole_model(mtp_loss_weight, depths):
    """λ = 0.3: the boundaries are (bs, seq, (1 + D)·dim); λ = 0 (the trainer enters no
    `mtp_targets`): plain (bs, seq, dim) boundaries, the depth idle on the last stage."""
    args = dataclasses.replace(ARGS, mtp_loss_weight=mtp_loss_weight, mtp_layers=depths)
    torch.manual_seed(0)
    whole = build_model(args)
    whole.init_weights()
    tokens = torch.randint(0, 97, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, 5] = -100
    stages = [pipeline.build_stage_module(whole, names) for names in STAGES]
    for stage in stages:
        stage.load_state_dict(whole.state_dict(), strict=False)
    assert [s.mtp is not None for s in stages] == [False, False, True]

    def targets(model):
        return mtp_targets(model, labels, 0.5) if mtp_loss_weight else contextlib.nullcontext()

    with targets(whole):
        want_logits = whole(inputs)
        _loss(want_logits, labels).backward()
    want = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}

    ins, outs, x = [], [], inputs
    for i, stage in enumerate(stages):
        x = x.detach().requires_grad_(True) if i else x
        ins.append(x)
        with targets(stage) if i == len(stages) - 1 else contextlib.nullcontext():
            x = stage(x)
        outs.append(x)
    width = (1 + depths if mtp_loss_weight else 1) * args.dim
    assert [o.shape[-1] for o in outs[:-1]] == [width, width]
    torch.testing.assert_close(outs[-1], want_logits, rtol=0, atol=1e-6)
    if mtp_loss_weight:
        torch.testing.assert_close(stages[-1].last_mtp_loss, whole.last_mtp_loss)
    _loss(outs[-1], labels).backward()
    for i in range(len(stages) - 2, -1, -1):  # each boundary's gradient to the stage before
        outs[i].backward(ins[i + 1].grad)
    got = {n: p.grad for s in stages for n, p in s.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert ("mtp.0.eh_proj.weight" in got) == bool(mtp_loss_weight)
    for n in want:
        scale = want[n].abs().max().item()
        assert (got[n] - want[n]).abs().max().item() <= 1e-6 + 1e-5 * scale, n


def test_the_cost_split_puts_trained_depths_on_the_last_stage():
    with torch.device("meta"):
        model = build_model(ARGS)
    params = unit_costs(model, ARGS, 16, "params")
    flops = unit_costs(model, ARGS, 16, "flops")
    idle = unit_costs(model, dataclasses.replace(ARGS, mtp_loss_weight=0.0), 16, "flops")
    depth = sum(p.numel() for p in model.mtp.parameters())
    head = model.norm.weight.numel() + model.output.weight.numel()
    assert params.head == head + depth  # held by the last stage whether it trains or not
    assert idle.head == 6 * head
    # the depth's block (routed experts at top_k / num_experts), eh_proj, norms, head again
    assert flops.head - idle.head > 6 * model.output.weight.numel() + max(flops.blocks[1:])
