"""DCP checkpointing: `Checkpointer` (save/resume) and `store` (folders, completeness)."""

from titanlab.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer"]
