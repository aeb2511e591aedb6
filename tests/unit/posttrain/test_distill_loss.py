"""The distillation loss equals a hand computation (float64 loops, 1e-6) and does not depend on
the chunk size."""

import math

import pytest
import torch

from titanlab.posttrain.distill import distillation_loss_sum
from titanlab.data.labels import IGNORE_INDEX


def by_hand(student, teacher, labels, alpha, t) -> float:
    total = 0.0
    for b in range(labels.shape[0]):
        for i in range(labels.shape[1]):
            y = int(labels[b, i])
            if y == IGNORE_INDEX:
                continue
            s, q = student[b, i].double().tolist(), teacher[b, i].double().tolist()
            log_z = math.log(sum(math.exp(v) for v in s))
            hard = log_z - s[y]
            zs = math.log(sum(math.exp(v / t) for v in s))
            zt = math.log(sum(math.exp(v / t) for v in q))
            kl = sum(
                math.exp(qv / t - zt) * ((qv / t - zt) - (sv / t - zs)) for sv, qv in zip(s, q)
            )
            total += alpha * hard + (1 - alpha) * t * t * kl
    return total


@pytest.mark.parametrize("alpha, t", [(0.5, 2.0), (0.0, 1.0), (1.0, 3.0), (0.3, 0.7)])
def test_equals_a_hand_computation(alpha, t):
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 11, generator=g) * 2
    teacher = torch.randn(2, 5, 11, generator=g) * 2
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 1] = labels[1, 4] = IGNORE_INDEX
    got = distillation_loss_sum(student, teacher, labels, alpha=alpha, temperature=t)
    assert abs(got.item() - by_hand(student, teacher, labels, alpha, t)) < 1e-6 * max(
        1.0, abs(got.item())
    )
    chunked = distillation_loss_sum(student, teacher, labels, alpha=alpha, temperature=t,
                                    chunk_tokens=3)  # fmt: skip
    assert abs(chunked.item() - got.item()) < 1e-5


def test_matching_teacher_leaves_only_the_hard_term():
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[1, 2, 3, 4]])
    soft_only = distillation_loss_sum(logits, logits, labels, alpha=0.0, temperature=2.0)
    assert abs(soft_only.item()) < 1e-6
