"""One PPO step of the Trainer (`rl.algorithm = "ppo"`): Proximal Policy Optimization
(Schulman et al. 2017, arXiv:1707.06347) as RLHF uses it (Ziegler et al. 2019; Ouyang et al.
2022, InstructGPT): the same rollouts as GRPO, then

- per-token rewards: −β (log π_old − log π_ref) on every completion token, plus the sequence's
  reward on its last counted token (EOS, or the last token of a truncated completion);
- values V_old and log π_old from one no-grad forward of the policy (its value head reads the
  trunk, `titanlab.posttrain.rl.value_head`); GAE(γ, λ) advantages and returns, the advantages
  whitened over the global batch;
- `rl.iterations` optimizer steps on the clipped surrogate + `rl.value_coef` × the clipped
  value loss, token mean over the global batch.
"""

from __future__ import annotations

import time

import torch

from titanlab.distributed import moe_stats
from titanlab.distributed.utils import global_sum
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.grpo import GRPO, Scored
from titanlab.posttrain.rl.value_head import read_values


class PPO(GRPO):
    """The PPO recipe (constructor as `GRPO`'s; the model carries a value head)."""

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        scored = self.sample_and_score(step)
        return self.update(scored, time.perf_counter() - t0, t0)

    def update(
        self, scored: Scored, t_rollout: float = 0.0, t0: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Values, GAE and `rl.iterations` optimizer steps on a scored rollout batch, then the
        LR step. Returns (loss, grad norm, metrics) over the global batch."""
        t0 = time.perf_counter() if t0 is None else t0
        rollout, loss_mask = scored.rollout, self.loss_mask(scored)
        with torch.no_grad(), moe_stats.stats_paused(self.model), self.autocast():
            with read_values(self.model) as values:
                old_logp = self.logprobs(self.model, rollout)
            old_values = rollout.completion_columns(values[-1])
            ref_logp = None
            if self.reference is not None:
                with moe_stats.stats_paused(self.reference):
                    ref_logp = self.logprobs(self.reference, rollout)
        advantages, returns, kl = self.advantages(scored, loss_mask, old_logp, ref_logp, old_values)
        denominator = global_sum(loss_mask.sum().float(), self.dp_mesh).clamp(min=1.0)
        loss, grad_norm, stats = self.optimize(
            rollout, advantages, loss_mask, denominator, old_logp=old_logp,
            value_targets=(old_values, returns),
        )  # fmt: skip
        stats["kl_sum"] = kl
        metrics = self.metrics(scored, stats, t_rollout, t0)
        tokens = global_sum(loss_mask.sum().float(), self.dp_mesh).clamp(min=1.0)
        metrics["rl/value_loss"] = (
            global_sum(stats["value_loss"], self.dp_mesh).cpu() / tokens.cpu()
        )
        metrics["rl/value_mean"] = (
            global_sum(torch.where(loss_mask, old_values, 0.0).sum(), self.dp_mesh) / tokens
        ).cpu()
        return loss, grad_norm, metrics

    def advantages(
        self, scored: Scored, loss_mask: torch.Tensor, old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None, old_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(whitened GAE advantages (B, N), returns (B, N), this rank's summed KL estimate)."""
        rl = self.rl
        token_rewards = torch.zeros_like(old_logp)
        kl_sum = torch.zeros((), device=old_logp.device)
        if ref_logp is not None:
            kl = old_logp - ref_logp  # k1, the per-token KL penalty of InstructGPT and TRL
            token_rewards = token_rewards - rl.beta * kl
            kl_sum = torch.where(loss_mask, kl, 0.0).sum()
        counted = loss_mask.sum(dim=1)
        last = (counted - 1).clamp(min=0)
        rows = torch.arange(len(last), device=last.device)
        rewards = scored.rewards.to(old_logp.device)
        token_rewards[rows, last] += torch.where(counted > 0, rewards, 0.0)
        adv, returns = obj.gae(token_rewards, old_values, loss_mask, rl.gamma, rl.lam)
        if rl.whiten_advantages:
            sums = torch.stack([loss_mask.sum().float(), torch.where(loss_mask, adv, 0.0).sum(),
                                torch.where(loss_mask, adv * adv, 0.0).sum()])  # fmt: skip
            n, total, squares = global_sum(sums, self.dp_mesh)
            mean = total / n.clamp(min=1.0)
            std = (squares / n.clamp(min=1.0) - mean * mean).clamp(min=0.0).sqrt()
            adv = torch.where(loss_mask, (adv - mean) / (std + 1e-8), 0.0)
        return adv, returns, kl_sum
