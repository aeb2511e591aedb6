"""A copy of a model's args with fewer blocks, every field that depends on the block count kept
consistent: what the activation tracer and the planner's calibrations build instead of the whole
model (one or a few blocks tell the per-block bytes and seconds).

Shortening `n_layers` alone breaks the families whose blocks are not all alike: DeepSeek-V3's
`n_dense_layers = 3` cannot exceed a 1-block copy's `n_layers`, and a copy of only dense first
blocks would measure the wrong kind of block. So a shortened copy keeps the model's first block
as it is and builds the others like the model's later blocks:

- `n_dense_layers` (DeepSeek-V3 `first_k_dense_replace`): at most 1, so block 0 stays dense when
  the model's is and every later block of the copy is an MoE block, the kind 58 of 671B's 61
  blocks are;
- `mlp_only_layers` (Qwen3-MoE): those that fall within the copy;
- `decoder_sparse_step` (Qwen3-MoE) and `mtp_layers` (prediction depths after the last block, not
  counted in `n_layers`) unchanged;
- `layer_types` (one entry per block, for families that alternate attention kinds): the first
  `n_layers` entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def shortened(args: Any, n_layers: int) -> Any:
    """`args` with `n_layers` blocks (1 <= n_layers), dependent fields as the module docstring
    says; `args` itself when it has no more than `n_layers` blocks.

    Raises:
        ValueError: n_layers < 1.
    """
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers} must be >= 1")
    if n_layers >= args.n_layers:
        return args
    change: dict[str, Any] = {"n_layers": n_layers}
    if hasattr(args, "n_dense_layers"):
        change["n_dense_layers"] = min(args.n_dense_layers, 1)
    if hasattr(args, "mlp_only_layers"):
        change["mlp_only_layers"] = tuple(i for i in args.mlp_only_layers if i < n_layers)
    if hasattr(args, "layer_types") and args.layer_types:
        change["layer_types"] = tuple(args.layer_types[:n_layers])
    return dataclasses.replace(args, **change)
