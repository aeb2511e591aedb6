"""The `[distill]` section: knowledge distillation from a teacher model."""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.config.errors import _require


@dataclass
class Distill:
    teacher_path: str = ""
    """A titanlab DCP folder of the teacher (a checkpoint, an export, or `convert_checkpoint
    from-hf` output of a Hugging Face model) with the same tokenizer. Empty: no distillation.
    The teacher runs forward only, in the same job, sharded like the student; under pipeline
    parallel it lives on the last stage's ranks and runs on each microbatch there. Refused
    under context parallel."""

    teacher_flavor: str = ""
    """The teacher's flavor of `model.name`; empty: the args in its `model_args.json`."""

    alpha: float = 0.5
    """Weight of the labels' cross-entropy; 1 − alpha weighs T² · KL(teacher ‖ student)."""

    temperature: float = 2.0
    """Softmax temperature T of both distributions in the KL term."""

    def validate(self) -> None:
        _require(0.0 <= self.alpha <= 1.0, f"distill.alpha={self.alpha} must be in [0, 1]")
        _require(self.temperature > 0, f"distill.temperature={self.temperature} must be > 0")
