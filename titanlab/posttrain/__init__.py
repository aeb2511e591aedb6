"""Training on top of a trained model beyond plain fine-tuning: knowledge distillation (the
loss, `distill`; the frozen teacher, `teacher`) and reinforcement learning from verifiable rewards
(`rl`: GRPO).

May import `config`, `models`, `distributed`, `data`, `checkpoint`, `generation` and
`components`.
"""
