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

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlab.config.job_config import JobConfig
from titanlab.distributed import moe_stats
from titanlab.distributed.utils import clip_grad_norm_, global_sum
from titanlab.generation.sampling import SamplingParams
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.logprobs import batch_width, sequence_logprobs
from titanlab.posttrain.rl.prompts import Example, PromptStream
from titanlab.posttrain.rl.rewards import RewardSet, exact_match, partial_credit
from titanlab.posttrain.rl.rollout import Rollout, gathered_weights, left_pad, sample_completions
from titanlab.posttrain.rl.value_head import read_values


@dataclass
class Scored:
    """A scored rollout batch of this rank: mask / truncated from `completion_mask`, lengths
    (B,) counted tokens, rewards (B,) and per function, group advantages (B,) and the groups
    whose rewards are all equal."""

    rollout: Rollout
    mask: torch.Tensor
    truncated: torch.Tensor
    lengths: torch.Tensor
    rewards: torch.Tensor
    per_fn: dict[str, torch.Tensor]
    advantages: torch.Tensor
    zero_std: torch.Tensor


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
        self.max_new_tokens = self.rl.max_new_tokens or (self.task.answer_len if self.task else 0)
        self.eval_set = stream.evaluation_prompts(self.rl.eval_prompts)
        self.params = SamplingParams(self.rl.temperature, self.rl.top_k, self.rl.top_p)

    # --- one step ------------------------------------------------------------------------
    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Rollout, rewards, advantages, then `rl.iterations` optimizer steps and one LR step.
        Returns (loss of the last iteration, its grad norm, metrics), 0-d float32 tensors equal
        on every rank."""
        rl, G = self.rl, self.rl.group_size
        t0 = time.perf_counter()
        scored = self.sample_and_score(step)
        t_rollout = time.perf_counter() - t0
        advantages = scored.advantages.to(self.device)
        loss_mask = self.loss_mask(scored)
        if rl.dynamic_sampling:
            loss_mask = loss_mask & ~scored.zero_std.to(self.device).repeat_interleave(G)[:, None]
        per_sequence = rl.loss_aggregation == "sequence_mean"
        count = loss_mask.any(dim=1).sum() if per_sequence else loss_mask.sum()
        denominator = global_sum(count.float(), self.dp_mesh).clamp(min=1.0)
        loss, grad_norm, stats = self.optimize(scored.rollout, advantages, loss_mask, denominator)
        return loss, grad_norm, self.metrics(scored, stats, t_rollout, t0)

    def sample_and_score(self, step: int) -> Scored:
        """This step's prompts, `group_size` sampled completions of each, their rewards and
        the group advantages."""
        G = self.rl.group_size
        examples = self.stream.next(self.config.training.local_batch_size // G)
        repeated = [e for e in examples for _ in range(G)]
        rollout = self.sample(repeated, self.params, seed=(step, self.dp_rank))
        mask, truncated = obj.completion_mask(rollout.completions, self.stream.stop_ids)
        lengths = mask.sum(dim=1)
        rewards, per_fn = self.rewards.score(*self.reward_inputs(repeated, rollout, truncated))
        advantages, zero_std = obj.group_advantages(rewards, G, self.rl.scale_rewards)
        return Scored(rollout, mask, truncated, lengths, rewards, per_fn, advantages, zero_std)

    def reward_inputs(
        self, examples: list[Example], rollout: Rollout, truncated: torch.Tensor
    ) -> tuple[list[str], list[str], list[dict]]:
        """What the reward functions read (`titanlab.posttrain.rl.rewards`): each completion's
        prompt text, its text before the stop token, and a fresh metadata dict with `finished`
        and `completion_ids`."""
        prompts, completions, metadata = [], [], []
        for e, row, cut in zip(examples, rollout.completions.tolist(), truncated.tolist()):
            n = len(row) if cut else 1 + next(i for i, t in enumerate(row)
                                              if t in self.stream.stop_ids)  # fmt: skip
            prompts.append(e.text)
            completions.append(self.stream.decode(row[: n if cut else n - 1]))
            metadata.append({**e.metadata, "finished": not cut, "completion_ids": row[:n]})
        return prompts, completions, metadata

    def loss_mask(self, scored: Scored) -> torch.Tensor:
        """The completion tokens that count: up to the first EOS, and with
        `rl.mask_truncated` none of a completion that has no EOS. (B, N) bool."""
        if self.rl.mask_truncated:
            return scored.mask & ~scored.truncated[:, None]
        return scored.mask

    def metrics(
        self, scored: Scored, stats: dict[str, torch.Tensor], t_rollout: float, t0: float
    ) -> dict[str, torch.Tensor]:
        s = scored
        metrics = self._metrics(s.rewards, s.per_fn, s.zero_std, s.lengths, s.truncated, stats)
        metrics["rl/rollout_s"] = torch.tensor(t_rollout)
        metrics["rl/train_s"] = torch.tensor(time.perf_counter() - t0 - t_rollout)
        return metrics

    def sample(self, examples: list[Example], params: SamplingParams, seed: tuple) -> Rollout:
        """A completion of each example's prompt from the policy, the sampling generator seeded
        by `seed` (so a resumed run samples what an uninterrupted one did)."""
        prompt_ids, prompt_lens = left_pad([e.ids for e in examples], self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(hash_seed(self.config.debug.seed, *seed))
        with (
            moe_stats.stats_paused(self.model),
            gathered_weights(self.model, self.rl.rollout_keep_gathered),
            self.autocast(),
        ):
            return sample_completions(
                self.model, prompt_ids, self.max_new_tokens, params, generator,
                self.stream.stop_ids, self.tp_degree, prompt_lens,
            )  # fmt: skip

    def optimize(
        self, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor,
        denominator: torch.Tensor, *, old_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None, value_targets: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """`rl.iterations` optimizer steps on one rollout batch, then the LR schedule's step.

        advantages: (B,) per completion (GRPO) or (B, N) per token (PPO). GRPO: π_old is the
        policy of the first iteration and the loss adds β · k3 to the reference. PPO passes
        `old_logp` (the sampling policy's), `value_targets` = (old values, returns), both
        (B, N), adding `rl.value_coef` × the clipped value loss, and puts its KL in the
        rewards instead. Returns the last iteration's (loss, grad norm) and the per-rank sums
        the metrics need."""
        rl = self.rl
        per_sequence = rl.loss_aggregation == "sequence_mean"
        kl_in_loss = value_targets is None
        if self.reference is not None and kl_in_loss:
            with torch.no_grad(), moe_stats.stats_paused(self.reference), self.autocast():
                ref_logp = self.logprobs(self.reference, rollout)
        stats: dict[str, torch.Tensor] = {}
        if old_logp is not None:
            gap = (old_logp - rollout.sampler_logp).abs()
            stats["max_sampler_gap"] = torch.where(loss_mask, gap, 0.0).max()
        for iteration in range(rl.iterations):
            self.optimizer.zero_grad()
            moe_stats.set_aux_grad_scale([self.model], 1, self.grad_avg_ranks)
            reading: contextlib.AbstractContextManager[list[torch.Tensor]] = (
                read_values(self.model) if value_targets else contextlib.nullcontext([])
            )
            with self.autocast(), reading as values:
                logp = self.logprobs(self.model, rollout)  # (B, N)
            if old_logp is None:  # μ = 1: ratio 1 in value, gradient ∇ log π (TRL, torchforge)
                old_logp = logp.detach()
                gap = (old_logp - rollout.sampler_logp).abs()
                stats["max_sampler_gap"] = torch.where(loss_mask, gap, 0.0).max()
            per_token, ratio = obj.clipped_surrogate(
                logp, old_logp, advantages, rl.epsilon_low, rl.epsilon_high
            )
            if ref_logp is not None and kl_in_loss:
                kl = obj.k3_kl(logp, ref_logp)
                per_token = per_token + rl.beta * kl
                stats["kl_sum"] = torch.where(loss_mask, kl.detach(), 0.0).sum()
            if value_targets is not None:
                old_values, returns = value_targets
                value_loss = obj.value_loss(rollout.completion_columns(values[-1]),
                                            old_values, returns, rl.value_clip)  # fmt: skip
                per_token = per_token + rl.value_coef * value_loss
                stats["value_loss"] = torch.where(loss_mask, value_loss.detach(), 0.0).sum()
            local = obj.aggregate_sum(per_token, loss_mask, per_sequence)
            (local * (self.grad_avg_ranks / denominator)).backward()
            # The parameters as they are after backward: a forward without grad (the rollout)
            # leaves FSDP's root and output groups gathered, their modules holding the unsharded
            # tensors until the next backward reshards them.
            params = list(self.model.parameters())
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

    def logprobs(self, model: nn.Module, rollout: Rollout) -> torch.Tensor:
        """log π(completion token | everything before it) at the sampling temperature, from one
        forward of the rollout's packed sequences (`Rollout.sequences`): (B, N) float32."""
        if not rollout.width:  # the same rows on every layout (`batch_width`)
            rollout.width = batch_width(rollout.sequences().shape[1], self.model, self.dp_mesh,
                                        self.device)  # fmt: skip
        sequences = rollout.sequences()
        logp = sequence_logprobs(model, sequences, self.rl.temperature, self.tp_degree)
        return rollout.completion_columns(logp)

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
        """Greedy completions of the held-out prompts (split over the dp ranks), scored with the
        reward functions: their weighted mean (`rl/eval_reward`), each function's, and the
        fraction exactly right and the mean partial credit against the prompts' answers."""
        mine = self.eval_set[self.dp_rank :: self.dp_degree]
        rollout = self.sample(mine, SamplingParams(), seed=(-1, self.dp_rank))
        _, truncated = obj.completion_mask(rollout.completions, self.stream.stop_ids)
        prompts, completions, metadata = self.reward_inputs(mine, rollout, truncated)
        total, per_fn = self.rewards.score(prompts, completions, metadata)
        sums = [total.sum(), *(v.sum() for v in per_fn.values())]
        for fn in (exact_match, partial_credit):
            sums.append(
                torch.tensor(sum(map(fn, prompts, completions, metadata)), dtype=torch.float)
            )
        sums.append(torch.tensor(float(len(mine))))
        *values, count = self._reduce(torch.stack(sums), dist.ReduceOp.SUM).tolist()
        names = ["rl/eval_reward", *(f"rl/eval_reward/{k}" for k in per_fn),
                 "rl/eval_exact_match", "rl/eval_partial_credit"]  # fmt: skip
        return {name: v / max(count, 1.0) for name, v in zip(names, values)}


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions."""
    h = 1469598103934665603
    for p in parts:
        for b in int(p).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 1099511628211) % (1 << 64)
    return h >> 1
