"""Silence the warnings every run printed that a user cannot act on, by exact message only.

- torchdata's StatefulDataLoader calls `torch.set_vital`, deprecated in torch 2.13:
  "'set_vital' is deprecated, please do not call".
- DTensor on a CPU mesh notes that its random ops may lack complete support ("DTensor random
  operators may not have complete support on cpu device mesh"): on CPU, the sharded parameters'
  random init is overwritten by a full-copy init (`components.init_model_weights`), so the weights
  do not depend on DTensor's CPU RNG and equal a single-process run's.
- FSDP2 notes, once per module, that a wrapped module "returned a view tensor" (`PATTERNS`):
  under 2D / 2.5D / 3D tensor parallel the embedding, the head and the model return
  `DTensor.to_local()`, a view; the warning is about in-place ops on that output, which no
  titanlab model or loss performs (copying the logits to avoid it would cost their memory again).

And log records (`LOG_MESSAGES`, by logger and exact text) on a machine without CUDA, where
they concern CUDA kernels that cannot run anyway: torchao's import reports its CUDA extensions
(`_C_mxfp8`, `_C_cutlass_90a`) and Triton missing, and torch 2.13 logs a deprecation when
torchao registers its Enums as pytree constants (torchao's code, not the user's).
"""

from __future__ import annotations

import logging
import re
import warnings

MESSAGES = (
    "'set_vital' is deprecated, please do not call",
    "DTensor random operators may not have complete support on cpu device mesh",
)

PATTERNS = (
    r"FSDP2-wrapped module \([\w, ]+\) returned a view tensor\. "
    + re.escape(
        "An in-place op on this view (e.g., `x += y`) will silently drop the pre-backward hook "
        "and skip the all-gather, which can cause backward to fail or produce wrong gradients. "
        "Use out-of-place ops (`out = out + y`, not `out += y`) or `.clone()` the output before "
        "any in-place op."
    ),
)
"""Regular expressions of whole warning messages (UserWarning) ignored everywhere."""


LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    "torchao": (
        r"Failed to load \S+/torchao/_C_mxfp8\.\S+\.so: Could not load this library: \S+",
        r"Failed to load \S+/torchao/_C_cutlass_90a\.abi3\.so: Could not load this library: \S+",
    ),
    "torchao.kernel.intmm": (
        r"Warning: Detected no triton, on systems without Triton certain kernels will not work",
    ),
    "torch.utils._pytree": (
        # torchao registers several Enums (KernelPreference, ScaleCalculationMode, ...).
        r"<enum '\w+'> is an Enum subclass and is now natively supported by "
        r"torch\.compile as an opaque value type\. Calling register_constant\(\) on Enum "
        r"subclasses is deprecated and will be an error in a future release\.",
    ),
}
"""Logger name → regular expressions of whole messages dropped on a machine without CUDA."""


class _DropExact(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p + r"\Z") for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def install(cuda: bool | None = None) -> None:
    """Ignore exactly the warnings in MESSAGES and PATTERNS (UserWarning, the whole message
    matched) and, without CUDA (`cuda`: default `torch.cuda.is_available()`), the log records
    in LOG_MESSAGES."""
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=UserWarning)
    for pattern in PATTERNS:
        warnings.filterwarnings("ignore", message=pattern + r"\Z", category=UserWarning)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        for name, patterns in LOG_MESSAGES.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropExact) for f in logger.filters):
                logger.addFilter(_DropExact(patterns))
