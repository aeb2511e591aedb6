"""One DPO step of the Trainer (`rl.algorithm = "dpo"`): Direct Preference Optimization
(Rafailov et al. 2023, arXiv:2305.18290, eq. 7).

For a prompt x with a chosen completion y_w and a rejected one y_l, the implicit reward of y is
r(y) = β · (log π_θ(y|x) − log π_ref(y|x)), log π(y|x) summed over the completion's tokens
(prompt tokens and padding masked by position), and the loss is −log σ(r(y_w) − r(y_l)),
averaged over the pairs of the global batch (each rank's sum divided by the global pair count,
so the gradient does not depend on the layout). π_ref is the frozen initial model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlab.config.job_config import JobConfig
from titanlab.distributed import moe_stats
from titanlab.distributed.utils import clip_grad_norm_
from titanlab.posttrain.rl.logprobs import batch_width, sequence_logprobs
from titanlab.posttrain.rl.pairs import Pair, PairStream


def dpo_loss(
    logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor, beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-pair −log σ(r_w − r_l) with r = β·(log π − log π_ref).

    Args: (P,) float32 summed completion log-probabilities of the policy and the reference.
    Returns: (loss (P,), reward_chosen (P,) detached, reward_rejected (P,) detached).
    """
    chosen = beta * (logp_chosen - ref_chosen)
    rejected = beta * (logp_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def pack(
    pairs: list[Pair], device: torch.device, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows prompt + chosen for every pair, then prompt + rejected, right-padded with 0 to the
    longest row (or `width`, when longer): (sequences (2P, S) int64, target mask (2P, S − 1)
    bool: the targets that are completion tokens)."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    length = max(width, max(len(p) + len(c) for p, c in rows))
    seqs = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        seqs[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = True
    return seqs.to(device), mask.to(device)


class DPO:
    """The DPO recipe over the Trainer's model, optimizer and LR schedule; `reference` is the
    frozen initial model. `training.local_batch_size` counts pairs per rank.
    Other arguments as for `titanlab.posttrain.rl.grpo.GRPO`."""

    def __init__(
        self,
        config: JobConfig,
        model: nn.Module,
        reference: nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        *,
        device: torch.device,
        dp_mesh: DeviceMesh | None,
        dp_rank: int,
        dp_degree: int,
        tp_degree: int,
        grad_avg_ranks: int,
        moe_mesh: DeviceMesh | None,
        autocast: Callable[[], Any],
        stream: PairStream,
    ) -> None:
        self.config, self.beta = config, config.rl.beta
        self.model, self.reference = model, reference
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.device, self.dp_mesh, self.dp_rank, self.dp_degree = (
            device,
            dp_mesh,
            dp_rank,
            dp_degree,
        )
        self.tp_degree, self.grad_avg_ranks, self.moe_mesh = tp_degree, grad_avg_ranks, moe_mesh
        self.autocast, self.stream = autocast, stream
        self.eval_pairs = stream.evaluation_pairs(config.rl.eval_prompts)

    def summed_logprobs(
        self, model: nn.Module, pairs: list[Pair]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (P,), rejected (P,)) summed completion log-probabilities under `model`."""
        longest = max(len(p) + max(len(c), len(r)) for p, c, r in pairs)
        width = batch_width(
            longest, self.model, self.dp_mesh, self.device
        )  # the same rows on every layout
        seqs, mask = pack(pairs, self.device, width)
        logp = sequence_logprobs(model, seqs, 1.0, self.tp_degree)
        total = torch.where(mask, logp, 0.0).sum(dim=1)
        return total[: len(pairs)], total[len(pairs) :]

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step on the next pairs; returns (loss, grad norm, metrics)."""
        return self.update(self.stream.next(self.config.training.local_batch_size))

    def update(
        self, pairs: list[Pair]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step on this rank's `pairs` (every rank the same number), then the LR
        schedule's step. Returns (loss, grad norm, metrics) over the global batch."""
        with torch.no_grad(), moe_stats.stats_paused(self.reference), self.autocast():
            ref_w, ref_l = self.summed_logprobs(self.reference, pairs)
        self.optimizer.zero_grad()
        moe_stats.set_aux_grad_scale([self.model], 1, self.grad_avg_ranks)
        with self.autocast():
            logp_w, logp_l = self.summed_logprobs(self.model, pairs)
        losses, r_w, r_l = dpo_loss(logp_w, logp_l, ref_w, ref_l, self.beta)
        global_pairs = len(pairs) * self.dp_degree
        (losses.sum() * (self.grad_avg_ranks / global_pairs)).backward()
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.config.training.max_norm)
        self.optimizer.step()
        moe_stats.end_step([self.model], self.moe_mesh, 1)
        self.lr_scheduler.step()
        sums = (
            self._sum(
                torch.stack(
                    [
                        losses.detach().sum(),
                        r_w.sum(),
                        r_l.sum(),
                        (r_w > r_l).float().sum(),
                        (r_w - r_l).sum(),
                    ]
                )
            )
            / global_pairs
        )
        metrics = {
            "rl/dpo_reward_chosen": sums[1],
            "rl/dpo_reward_rejected": sums[2],
            "rl/dpo_reward_accuracy": sums[3],
            "rl/dpo_reward_margin": sums[4],
        }
        return sums[0], grad_norm.detach().float(), metrics

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        values = values.float().to(self.device)
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.dp_mesh.get_group())
        return values.cpu()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairs (split over the dp ranks): the share whose chosen completion has the
        higher implicit reward, and the mean margin."""
        mine = self.eval_pairs[self.dp_rank :: self.dp_degree]
        with (
            moe_stats.stats_paused(self.model),
            moe_stats.stats_paused(self.reference),
            self.autocast(),
        ):
            w, l = self.summed_logprobs(self.model, mine)
            ref_w, ref_l = self.summed_logprobs(self.reference, mine)
        _, r_w, r_l = dpo_loss(w, l, ref_w, ref_l, self.beta)
        total = self._sum(torch.stack([(r_w > r_l).float().sum(), (r_w - r_l).sum(),
                                       torch.tensor(float(len(mine)), device=r_w.device)]))  # fmt: skip
        return {
            "rl/eval_reward_accuracy": float(total[0] / total[2]),
            "rl/eval_reward_margin": float(total[1] / total[2]),
        }
