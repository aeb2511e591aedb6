"""One GRPO, PPO or DPO update of the real Trainer on fixed data, for layout parity tests.

Run on warm ranks (`tools.lib.rank_pool`, target `rl_fixed_step:pool_main`) or under torchrun:
`rl_fixed_step.py OUT [trainer overrides...]`. Every layout sees the same
global rollout batch (prompts of 5 to 7 tokens, completions with EOS at various positions,
rewards), each
data-parallel rank its own slice of whole groups; the Trainer's GRPO recipe then runs
`optimize` (μ = `rl.iterations` optimizer steps, β · k3 to the reference); PPO its `update`
(values, GAE, policy and value losses). DPO: fixed digit
preference pairs of prompts of 5 to 7 tokens, each rank its slice, two `update`s. With
`--peft.method lora` the reference is the policy with its adapters off. Rank 0 writes the
loss, the grad norm and the full parameters after the update to OUT (torch.save).
"""

from __future__ import annotations

import random
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanlab.config.manager import build_config
from titanlab.data.digit_tasks import EOS, VOCAB_SIZE, DigitTask
from titanlab.distributed.init import destroy_distributed, exit_process
from titanlab.distributed.utils import global_sum
from titanlab.posttrain.rl import objectives as obj
from titanlab.posttrain.rl.dpo import DPO
from titanlab.posttrain.rl.grpo import Scored
from titanlab.posttrain.rl.ppo import PPO
from titanlab.posttrain.rl.rollout import Rollout, left_pad
from titanlab.trainer import Trainer


def tasks(kind: str, n: int) -> list[DigitTask]:
    """`n` digit tasks of 3, 4 and 5 digits in turn: prompts of different lengths."""
    return [DigitTask(kind, 3 + i % 3) for i in range(n)]


def fixed_batch(kind: str, group_size: int, batch: int, new_tokens: int):
    """(prompts (B, P) left-padded, prompt lengths (B,), completions (B, N), rewards (B,)) the
    same on every rank and layout."""
    gen = torch.Generator().manual_seed(1234)
    prompts = [t.draw(random.Random(i), False)[0]
               for i, t in enumerate(tasks(kind, batch // group_size))]  # fmt: skip
    padded, lens = left_pad(prompts, torch.device("cpu"))
    prompt_ids = padded.repeat_interleave(group_size, dim=0)
    completions = torch.randint(0, 10, (batch, new_tokens), generator=gen)
    eos_at = torch.randint(0, new_tokens + 1, (batch,), generator=gen)  # N: truncated
    for b, at in enumerate(eos_at.tolist()):
        completions[b, at:] = EOS
    rewards = torch.rand(batch, generator=gen)
    rewards[:group_size] = 0.5  # one group with equal rewards
    return prompt_ids, lens.repeat_interleave(group_size), completions, rewards


def main(out: str, argv: list[str]) -> None:
    trainer = Trainer(build_config(argv))
    rl, dims = trainer.rl, trainer.parallel_dims
    assert rl is not None
    local = trainer.config.training.local_batch_size
    mine = slice(dims.dp_rank() * local, (dims.dp_rank() + 1) * local)
    if isinstance(rl, DPO):
        n = local * dims.dp_degree
        pairs = [t.preference_pair(random.Random(i), False)
                 for i, t in enumerate(tasks(trainer.config.rl.task, 2 * n))]  # fmt: skip
        rl.update(pairs[:n][mine])  # the first step's loss is log 2 on every layout
        loss, grad_norm, _ = rl.update(pairs[n:][mine])
        return finish(trainer, loss, grad_norm, out)
    prompts, lens, completions, rewards = fixed_batch(
        trainer.config.rl.task, rl.rl.group_size, local * dims.dp_degree, rl.max_new_tokens
    )
    assert int(completions.max()) < VOCAB_SIZE
    advantages, _ = obj.group_advantages(rewards, rl.rl.group_size)
    mask, _ = obj.completion_mask(completions, EOS)
    rollout = Rollout(prompts[mine], completions[mine], torch.zeros(local, rl.max_new_tokens),
                      lens[mine])  # fmt: skip
    # A rollout first, as in a run: its forwards without grad leave FSDP's root and output
    # groups gathered (a gradient clip that listed the parameters then missed their gradients).
    rl.sample(rl.stream.next(local), rl.params, seed=(0, dims.dp_rank()))
    if isinstance(rl, PPO):  # values, GAE and the value loss on the same batch
        truncated = mask[mine].all(dim=1) & (completions[mine][:, -1] != EOS)
        scored = Scored(
            rollout,
            mask[mine],
            truncated,
            mask[mine].sum(dim=1),
            rewards[mine],
            {},
            advantages[mine],
            torch.zeros(local // rl.rl.group_size, dtype=torch.bool),
        )
        loss, grad_norm, _ = rl.update(scored)
        return finish(trainer, loss, grad_norm, out)
    denominator = global_sum(mask[mine].sum().float(), trainer._loss_mesh).clamp(min=1.0)
    loss, grad_norm, _ = rl.optimize(rollout, advantages[mine], mask[mine], denominator)
    finish(trainer, loss, grad_norm, out)


def finish(trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor, out: str) -> None:
    """Rank 0 writes the loss, grad norm and full parameters; every rank ends its group."""
    params = get_model_state_dict(
        trainer.model_parts[0], options=StateDictOptions(full_state_dict=True)
    )
    if trainer.rank == 0:
        torch.save(
            {
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
                "params": {k: v.detach().clone() for k, v in params.items()},
            },
            out,
        )
    trainer.close()
    destroy_distributed(barrier=True)


def pool_main(argv: list[str]) -> int:
    """A warm worker's entry (`tools.lib.rank_pool`): argv is OUT then the overrides."""
    main(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_process(0)  # no interpreter finalization under torchrun (a gloo thread can abort there)
