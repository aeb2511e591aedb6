"""Reinforcement learning from verifiable rewards on the training stack (`[rl]`): GRPO's
objective (`objectives`), reward functions (`rewards`), the prompt stream (`prompts`), rollouts
with the policy module itself (`rollout`), the frozen reference (`reference`), pre-flight checks
(`checks`) and the step (`grpo`). May import config, models, data, distributed, generation,
checkpoint and components."""
