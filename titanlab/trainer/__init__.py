"""The Trainer: the training recipe (`trainer`), its step (`step`) and the LoRA/QLoRA steps it
takes around parallelize (`peft_steps`).

May import every package except `generation` and the entry points.
"""

from titanlab.trainer.trainer import Trainer

__all__ = ["Trainer"]
