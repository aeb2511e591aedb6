"""The Trainer: the training recipe (`trainer`), its step (`step`), the LoRA/QLoRA steps it
takes around parallelize (`peft_steps`) and the reinforcement-learning parts that replace the
data and the step under `[rl]` (`rl_steps`).

May import every package except the entry points.
"""

from titanlab.trainer.trainer import Trainer

__all__ = ["Trainer"]
