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

from titanlab.data.labels import IGNORE_INDEX

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
        student_logits: (bs, seq, vocab), any float dtype.
        teacher_logits: (bs, seq, vocab), any float dtype, the student's vocab.
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


class PipelineDistillLoss:
    """The loss of a pipeline's last stage in a distillation run (the `loss_fn` of the
    `torch.distributed.pipelining` schedule, like `titanlab.components.loss.ScaledLoss`).

    The schedule calls `loss_fn(output, target)` once per microbatch, with `target` split from the
    whole batch's along dim 0 exactly as the inputs are. Here the target is the batch's row
    numbers (`rows_of`): the call finds its microbatch's inputs, labels and model keywords in the
    batch given to `prepare`, runs the teacher on them (no grad) and returns
    `distillation_loss_sum` × `scale`. Only one microbatch of teacher logits exists at a time.

    Attributes:
        teacher: the teacher model, set by the trainer once it is built (last-stage ranks only).
        scale: set by the trainer each step, as for `ScaledLoss`.
    """

    def __init__(self, alpha: float, temperature: float) -> None:
        self.alpha, self.temperature = alpha, temperature
        self.teacher: torch.nn.Module | None = None
        self.scale: float | torch.Tensor = 1.0
        self._batch: tuple[torch.Tensor, torch.Tensor, dict] | None = None

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> None:
        """Hold this step's (bs, seq) batch: inputs, labels and the model's keywords."""
        self._batch = (inputs, labels, kwargs)

    @staticmethod
    def rows_of(labels: torch.Tensor) -> torch.Tensor:
        """The schedule's target for a (bs, seq) batch: its row numbers, (bs,) int64."""
        return torch.arange(labels.shape[0], device=labels.device)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        assert self.teacher is not None and self._batch is not None, "prepare() first"
        inputs, labels, kwargs = self._batch
        with torch.no_grad():
            teacher_logits = self.teacher(inputs[rows], **{k: v[rows] for k, v in kwargs.items()})
        loss = distillation_loss_sum(
            logits, teacher_logits, labels[rows], alpha=self.alpha, temperature=self.temperature
        )
        return loss * self.scale
