"""Training on top of a trained model beyond plain fine-tuning: knowledge distillation (the
loss, `distill`; the frozen teacher, `teacher`); reward- and preference-based training will
live here.

May import `config`, `models`, `distributed`, `data`, `checkpoint` and `components`.
"""
