"""Silence the warnings every run printed that a user cannot act on, by exact message only.

- torchdata's StatefulDataLoader calls `torch.set_vital`, deprecated in torch 2.13:
  "'set_vital' is deprecated, please do not call".
- DTensor on a CPU mesh notes that its random ops may lack complete support ("DTensor random
  operators may not have complete support on cpu device mesh"): on CPU, the sharded parameters'
  random init is overwritten by a full-copy init (`components.init_model_weights`), so the weights
  do not depend on DTensor's CPU RNG and equal a single-process run's.
"""

from __future__ import annotations

import re
import warnings

MESSAGES = (
    "'set_vital' is deprecated, please do not call",
    "DTensor random operators may not have complete support on cpu device mesh",
)


def install() -> None:
    """Ignore exactly the warnings in MESSAGES (UserWarning, the whole message matched)."""
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=UserWarning)
