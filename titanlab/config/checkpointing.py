"""The `[checkpoint]` section: DCP checkpoints, resume, seed checkpoint and exports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlab.config.errors import ConfigError, _require  # noqa: F401


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints and resume from the newest complete one at start."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder (or absolute). Steps go to `<folder>/step-N`."""

    interval: int = 500
    """Save every this many steps (and always at the last step)."""

    keep_latest_k: int = 10
    """Keep only the newest k complete checkpoints (0: keep all). The seed checkpoint (step-0) is kept."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """`async`: write in a background thread while training continues (dcp.async_save)."""

    load_step: int = -1
    """Resume from this step instead of the newest complete checkpoint (-1: newest)."""

    initial_load_path: str = ""
    """A checkpoint folder (e.g. a seed checkpoint's `step-0`, or one converted from Hugging
    Face) to start from when `folder` holds no checkpoint yet. Ignored once the run has its own.
    Loaded with `enable = false` too (then nothing else is loaded or saved)."""

    initial_load_model_only: bool = True
    """Load only the model weights from `initial_load_path` (fresh optimizer, step 0)."""

    create_seed_checkpoint: bool = False
    """Initialize the model on one process, save it as step-0 and exit, so every parallel layout
    can start from identical weights. Run with a single process."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the final model-only export written at the end of training (`<folder>/export`)."""

    export_at_end: bool = True
    """At the last step, also write the model weights alone (no optimizer) in `export_dtype`."""

    last_save_in_hf: bool = False
    """With `export_at_end`, also write the final export as a Hugging Face folder
    (`<folder>/hf-step-N`: safetensors in `export_dtype`, config.json, and the tokenizer files
    when the model uses the bundled tokenizer), converted on rank 0 by the same code as
    `tools/convert_checkpoint.py to-hf`. Loads with `transformers` and vLLM."""

    def validate(self) -> None:
        _require(self.interval >= 1, f"checkpoint.interval={self.interval} must be >= 1")
        _require(
            self.keep_latest_k >= 0, f"checkpoint.keep_latest_k={self.keep_latest_k} must be >= 0"
        )
        _require(self.load_step >= -1, f"checkpoint.load_step={self.load_step} must be -1 or >= 0")
        _require(bool(self.folder), "checkpoint.folder must not be empty")
        _require(
            not self.last_save_in_hf or self.export_at_end,
            "checkpoint.last_save_in_hf=true needs checkpoint.export_at_end=true "
            "(the Hugging Face folder is converted from the export)",
        )
