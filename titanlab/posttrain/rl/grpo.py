"""One GRPO step of the Trainer (`rl.algorithm = "grpo"`): draw prompts, sample G completions of
each with the policy, score them, then `rl.iterations` optimizer steps on the clipped surrogate
plus β · k3 KL (formulas and sources: `titanlab.posttrain.rl.objectives`).

Everything runs SPMD in the training processes. Each data-parallel rank draws its own prompts and
keeps all G completions of a prompt, so advantages need no communication; tensor-parallel ranks
of one dp rank draw and sample the same. The loss is normalized by the global count of
completion tokens (or completions), summed over the dp ranks, so the gradient does not depend on
the layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlab.config.job_config import JobConfig
from titanlab.data.digit_tasks import EOS
from titanlab.distributed import moe_stats
from titanlab.distributed.utils import clip_grad_norm_, global_sum
from titanlab.generation.sampling import SamplingParams
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.logprobs import sequence_logprobs
from titanlab.posttrain.rl.prompts import PromptStream
from titanlab.posttrain.rl.rewards import RewardSet, exact_match, partial_credit
from titanlab.posttrain.rl.rollout import Rollout, gathered_weights, sample_completions


class GRPO:
    """The GRPO recipe over the Trainer's model, optimizer and LR schedule.

    Args:
        model: the policy (one model part: PP is refused); reference: the frozen initial model
            (None when `rl.beta == 0`); dp_mesh: the data-parallel ranks (None: one);
        dp_rank: this rank's data-parallel index; tp_degree: tensor-parallel degree;
        grad_avg_ranks: ranks FSDP/DDP average gradients over; moe_mesh: the ranks MoE load
            statistics are summed over; autocast: the Trainer's autocast context factory;
        stream: this rank's prompts (the Trainer's checkpointed data state).
    Raises:
        ConfigError: a reward function that cannot be imported (from `RewardSet`).
    """

    def __init__(
        self,
        config: JobConfig,
        model: nn.Module,
        reference: nn.Module | None,
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
        stream: PromptStream,
    ) -> None:
        self.config, self.rl = config, config.rl
        self.model, self.reference = model, reference
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.device, self.dp_mesh, self.dp_rank, self.dp_degree = (
            device,
            dp_mesh,
            dp_rank,
            dp_degree,
        )
        self.tp_degree, self.grad_avg_ranks, self.autocast = tp_degree, grad_avg_ranks, autocast
        self.moe_mesh, self.stream = moe_mesh, stream
        self.task = stream.task
        self.rewards = RewardSet(self.rl.rewards, self.rl.reward_weights)
        self.max_new_tokens = self.rl.max_new_tokens or self.task.answer_len
        self.eval_set = self.task.held_out_set(self.rl.eval_prompts, config.debug.seed)
        self.params = SamplingParams(self.rl.temperature, self.rl.top_k, self.rl.top_p)

    # --- one step ------------------------------------------------------------------------
    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Rollout, rewards, advantages, then `rl.iterations` optimizer steps and one LR step.
        Returns (loss of the last iteration, its grad norm, metrics), 0-d float32 tensors equal
        on every rank."""
        rl, G = self.rl, self.rl.group_size
        t0 = time.perf_counter()
        prompts, metadata = self.stream.next(self.config.training.local_batch_size // G)
        prompt_ids = torch.tensor(prompts, device=self.device).repeat_interleave(G, dim=0)
        rollout = self.sample(prompt_ids, self.params, seed=(step, self.dp_rank))
        t_rollout = time.perf_counter() - t0
        mask, truncated = obj.completion_mask(rollout.completions, EOS)
        lengths = mask.sum(dim=1)
        completions = [row[:n] for row, n in zip(rollout.completions.tolist(), lengths.tolist())]
        rewards, per_fn = self.rewards.score(
            [p for p in prompts for _ in range(G)],
            completions,
            [m for m in metadata for _ in range(G)],
        )
        advantages, zero_std = obj.group_advantages(rewards, G, rl.scale_rewards)
        advantages = advantages.to(self.device)
        loss_mask = mask
        if rl.mask_truncated:
            loss_mask = loss_mask & ~truncated[:, None]
        if rl.dynamic_sampling:
            loss_mask = loss_mask & ~zero_std.to(self.device).repeat_interleave(G)[:, None]
        per_sequence = rl.loss_aggregation == "sequence_mean"
        count = loss_mask.any(dim=1).sum() if per_sequence else loss_mask.sum()
        denominator = global_sum(count.float(), self.dp_mesh).clamp(min=1.0)
        loss, grad_norm, stats = self.optimize(rollout, advantages, loss_mask, denominator)
        t_train = time.perf_counter() - t0 - t_rollout
        metrics = self._metrics(rewards, per_fn, zero_std, lengths, truncated, stats)
        metrics["rl/rollout_s"] = torch.tensor(t_rollout)
        metrics["rl/train_s"] = torch.tensor(t_train)
        return loss, grad_norm, metrics

    def sample(self, prompt_ids: torch.Tensor, params: SamplingParams, seed: tuple) -> Rollout:
        """Completions of `prompt_ids` from the policy, the sampling generator seeded by `seed`
        (so a resumed run samples what an uninterrupted one did)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(hash_seed(self.config.debug.seed, *seed))
        with (
            moe_stats.stats_paused(self.model),
            gathered_weights(self.model, self.rl.rollout_keep_gathered),
            self.autocast(),
        ):
            return sample_completions(
                self.model, prompt_ids, self.max_new_tokens, params, generator, EOS,
                self.tp_degree,
            )  # fmt: skip

    def optimize(
        self, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor,
        denominator: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """`rl.iterations` optimizer steps on one rollout batch, then the LR schedule's step.
        Returns the last iteration's (loss, grad norm) and the per-rank sums the metrics need."""
        rl = self.rl
        per_sequence = rl.loss_aggregation == "sequence_mean"
        sequences = torch.cat([rollout.prompts, rollout.completions], dim=1)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad(), moe_stats.stats_paused(self.reference), self.autocast():
                ref_logp = self.logprobs(self.reference, sequences)
        old_logp = None
        stats: dict[str, torch.Tensor] = {}
        params = [p for p in self.model.parameters()]
        for iteration in range(rl.iterations):
            self.optimizer.zero_grad()
            moe_stats.set_aux_grad_scale([self.model], 1, self.grad_avg_ranks)
            with self.autocast():
                logp = self.logprobs(self.model, sequences)  # (B, N)
            if old_logp is None:  # μ = 1: ratio 1 in value, gradient ∇ log π (TRL, torchforge)
                old_logp = logp.detach()
                gap = (old_logp - rollout.sampler_logp).abs()
                stats["max_sampler_gap"] = torch.where(loss_mask, gap, 0.0).max()
            per_token, ratio = obj.clipped_surrogate(
                logp, old_logp, advantages, rl.epsilon_low, rl.epsilon_high
            )
            if ref_logp is not None:
                kl = obj.k3_kl(logp, ref_logp)
                per_token = per_token + rl.beta * kl
                stats["kl_sum"] = torch.where(loss_mask, kl.detach(), 0.0).sum()
            local = obj.aggregate_sum(per_token, loss_mask, per_sequence)
            (local * (self.grad_avg_ranks / denominator)).backward()
            grad_norm = clip_grad_norm_(params, self.config.training.max_norm)
            self.optimizer.step()
            moe_stats.end_step([self.model], self.moe_mesh, 1)
        self.lr_scheduler.step()
        low, high = obj.clip_fractions(ratio, advantages, loss_mask, rl.epsilon_low,
                                       rl.epsilon_high)  # fmt: skip
        stats.update(clip_low=low, clip_high=high, tokens=loss_mask.sum().float())
        stats["ratio_max"] = torch.where(loss_mask, ratio, 0.0).max()
        loss = global_sum(local.detach(), self.dp_mesh) / denominator
        return loss, grad_norm.detach().float(), stats

    def logprobs(self, model: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
        """log π(completion token | everything before it) at the sampling temperature:
        (B, N) float32 for `sequences` = prompts (P tokens) then completions (N tokens)."""
        logp = sequence_logprobs(model, sequences, self.rl.temperature, self.tp_degree)
        return logp[:, sequences.shape[1] - self.max_new_tokens - 1 :]

    # --- metrics and evaluation ---------------------------------------------------------
    def _metrics(
        self, rewards: torch.Tensor, per_fn: dict[str, torch.Tensor], zero_std: torch.Tensor,
        lengths: torch.Tensor, truncated: torch.Tensor, stats: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Global (over dp ranks) metrics from this rank's values: one SUM and one MAX
        all-reduce."""
        n = float(rewards.numel())
        sums = {
            "count": torch.tensor(n),
            "reward": rewards.sum(),
            "reward_sq": (rewards.double() ** 2).sum().float(),
            "groups": torch.tensor(float(zero_std.numel())),
            "zero_std": zero_std.float().sum(),
            "length": lengths.float().sum().cpu(),
            "truncated": truncated.float().sum().cpu(),
            "tokens": stats["tokens"].cpu(),
            "clip_low": stats["clip_low"].cpu(),
            "clip_high": stats["clip_high"].cpu(),
            "kl": stats.get("kl_sum", torch.zeros(())).cpu(),
            **{f"fn/{k}": v.sum() for k, v in per_fn.items()},
        }
        maxes = {
            "length_max": lengths.float().max().cpu(),
            "ratio_max": stats["ratio_max"].cpu(),
            "sampler_gap": stats["max_sampler_gap"].cpu(),
        }
        s = dict(zip(sums, self._reduce(torch.stack(list(sums.values())), dist.ReduceOp.SUM)))
        m = dict(zip(maxes, self._reduce(torch.stack(list(maxes.values())), dist.ReduceOp.MAX)))
        mean = s["reward"] / s["count"]
        tokens = s["tokens"].clamp(min=1)
        out = {
            "rl/reward_mean": mean,
            "rl/reward_std": (s["reward_sq"] / s["count"] - mean**2).clamp(min=0).sqrt(),
            "rl/frac_zero_std_groups": s["zero_std"] / s["groups"],
            "rl/completion_len_mean": s["length"] / s["count"],
            "rl/completion_len_max": m["length_max"],
            "rl/truncated_frac": s["truncated"] / s["count"],
            "rl/clip_low_frac": s["clip_low"] / tokens,
            "rl/clip_high_frac": s["clip_high"] / tokens,
            "rl/ratio_max": m["ratio_max"],
            "rl/sampler_logp_max_diff": m["sampler_gap"],
        }
        if self.reference is not None:
            out["rl/kl"] = s["kl"] / tokens
        out.update({f"rl/reward/{k[3:]}": v / s["count"] for k, v in s.items() if k[:3] == "fn/"})
        return out

    def _reduce(self, values: torch.Tensor, op: Any) -> torch.Tensor:
        values = values.float().to(self.device)
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            dist.all_reduce(values, op=op, group=self.dp_mesh.get_group())
        return values.cpu()

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts (split over the dp ranks): the fraction
        exactly right and the mean partial credit."""
        mine = self.eval_set[self.dp_rank :: self.dp_degree]
        prompts = [p for p, _ in mine]
        rollout = self.sample(
            torch.tensor(prompts, device=self.device), SamplingParams(), seed=(-1, self.dp_rank)
        )
        mask, _ = obj.completion_mask(rollout.completions, EOS)
        exact = partial = 0.0
        for (p, meta), row, n in zip(mine, rollout.completions.tolist(), mask.sum(1).tolist()):
            exact += exact_match(p, row[:n], meta)
            partial += partial_credit(p, row[:n], meta)
        total = self._reduce(torch.tensor([exact, partial, float(len(mine))]), dist.ReduceOp.SUM)
        return {
            "rl/eval_exact_match": float(total[0] / total[2]),
            "rl/eval_partial_credit": float(total[1] / total[2]),
        }


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions."""
    h = 1469598103934665603
    for p in parts:
        for b in int(p).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 1099511628211) % (1 << 64)
    return h >> 1
