"""The fused loss's pipeline glue: `take_labels` hands each forward's `labels` keyword to the
stage's fused head and clears it after; a stage without the head drops the keyword."""

from __future__ import annotations

import torch
from torch import nn

from titanlab.components.fused_ce import linear_cross_entropy_sum
from titanlab.components.fused_head import use_fused_loss
from titanlab.components.fused_pipeline import returned_loss, take_labels
from titanlab.components.loss import ScaledLoss


class _Stage(nn.Module):
    def __init__(self, with_head: bool) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.output = nn.Linear(8, 32, bias=False) if with_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.output(h) if self.output is not None else h


def test_the_last_stage_returns_its_microbatchs_loss_and_then_logits_again():
    torch.manual_seed(0)
    stage = _Stage(with_head=True)
    use_fused_loss(stage, chunk_size=3)
    take_labels(stage)
    x, labels = torch.randn(2, 5, 8), torch.randint(32, (2, 5))
    labels[0, 1] = -100
    out = stage(x, labels=labels)
    assert out.shape == (1,)  # the schedule concatenates the outputs along dim 0
    want = linear_cross_entropy_sum(stage.body(x), stage.output.weight, labels, 3)
    assert torch.equal(returned_loss(out, labels), want) and returned_loss(out, labels).dim() == 0
    assert stage.output.labels is None
    assert stage(x).shape == (2, 5, 32)  # no labels: logits


def test_a_stage_without_the_head_drops_the_keyword():
    stage = _Stage(with_head=False)
    take_labels(stage)
    x = torch.randn(2, 5, 8)
    assert torch.equal(stage(x, labels=torch.zeros(2, 5, dtype=torch.long)), stage(x))


def test_a_split_backward_frees_the_last_stages_graph_and_gives_the_full_gradients():
    """Zero-bubble schedules run torch's `stage_backward_input`, then detach the stage's output
    in place (`PipelineStage.backward_one_chunk`, which skips views), and later
    `stage_backward_weight`. The output is kept to the step's end (`output_chunks`): were it a
    view, it would keep the graph, and every tensor saved by nodes the weight half never runs
    (attention's, the activation's), alive until then (measured: +9.7 MiB on the debug model's
    ZBV step)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    stage = _Stage(with_head=True)
    use_fused_loss(stage, chunk_size=3)
    take_labels(stage)
    x, labels = torch.randn(2, 5, 8, requires_grad=True), torch.randint(32, (2, 5))
    out = stage(x, labels=labels)
    loss = ScaledLoss(returned_loss)(out, labels)  # the trainer's loss_fn with the fused head
    _, groups = stage_backward_input([loss], None, [x], stage.parameters())
    assert not out._is_view()
    out.detach_()  # what the stage does to its output after the input half
    assert out.grad_fn is None
    stage_backward_weight(stage.parameters(), groups)
    split = [x.grad.clone()] + [p.grad.clone() for p in stage.parameters()]

    x.grad = None
    stage.zero_grad()
    ScaledLoss(returned_loss)(stage(x, labels=labels), labels).backward()
    whole = [x.grad] + [p.grad for p in stage.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(split, whole))
