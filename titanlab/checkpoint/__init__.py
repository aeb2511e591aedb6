"""Checkpoints: DCP save and resume (`Checkpointer`, `manager`), folders and completeness
(`store`), and conversion to and from Hugging Face, PEFT adapters (`peft_export`) and GGUF.

May import `config`, `models`, `peft` and `data` (tokenizer files travel with exports).
"""

from titanlab.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer"]
