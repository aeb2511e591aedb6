"""Knowledge distillation (Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural
Network"): the student trains on a mix of the labels' cross-entropy and the teacher's softened
distribution.

Per target token (labels not IGNORE_INDEX):

    loss = alpha · CE(student, label) + (1 − alpha) · T² · KL(p_teacher,T ‖ p_student,T)

with p_·,T = softmax(logits / T). The T² keeps the soft term's gradient on the scale of the hard
one as T changes (Hinton et al., section 2). The KL is the forward one, teacher ‖ student: the
expectation is under the teacher, so the student is pushed to put mass wherever the teacher does
(mass-covering), which is the cross-entropy against soft targets of the paper up to the
teacher's entropy, a constant for the student. The sum over tokens is normalized by the global
token count like the plain loss. Logits are processed in chunks of tokens so that at most one
chunk of each of the two fp32 (tokens × vocab) tensors exists at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlab.loss import IGNORE_INDEX

CHUNK_TOKENS = 1024


def distillation_loss_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Sum over target tokens of the distillation loss (module docstring), fp32.

    Args:
        student_logits / teacher_logits: (bs, seq, vocab), any float dtype, same vocab.
        labels: (bs, seq) int64, IGNORE_INDEX where no target.
        alpha: weight of the hard (label) cross-entropy, in [0, 1].
        temperature: T > 0.
        chunk_tokens: tokens converted to fp32 at a time.
    Returns:
        0-dim fp32 tensor.
    """
    s = student_logits.flatten(0, 1)
    t = teacher_logits.flatten(0, 1)
    y = labels.flatten()
    total = torch.zeros((), dtype=torch.float32, device=s.device)
    for start in range(0, y.numel(), chunk_tokens):
        stop = start + chunk_tokens
        keep = y[start:stop] != IGNORE_INDEX
        if not keep.any():
            continue
        ss, tt = s[start:stop][keep].float(), t[start:stop][keep].float()
        hard = F.cross_entropy(ss, y[start:stop][keep], reduction="sum")
        log_ps = F.log_softmax(ss / temperature, dim=-1)
        log_pt = F.log_softmax(tt / temperature, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_ps)).sum()
        total = total + alpha * hard + (1.0 - alpha) * temperature**2 * kl
    return total


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher ‖ p_student) at temperature 1 (a diagnostic)."""
    log_ps = F.log_softmax(student_logits.float(), dim=-1)
    log_pt = F.log_softmax(teacher_logits.float(), dim=-1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
