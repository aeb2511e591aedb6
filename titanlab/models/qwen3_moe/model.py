"""Qwen3-MoE decoder in plain PyTorch (the shared `Decoder` with `MoE` blocks).

After Hugging Face's `Qwen3MoeForCausalLM` and the Qwen3 Technical Report (2025): Qwen3's
attention (per-head q/k RMSNorm, explicit head_dim, rope_theta 1e6) and, in the sparse blocks,
a router + routed SwiGLU experts (`titanlab.models.common.moe`).
"""

from __future__ import annotations

from titanlab.models.common.decoder import Decoder
from titanlab.models.qwen3_moe.args import Qwen3MoEModelArgs


class Qwen3MoETransformer(Decoder):
    """Qwen3-MoE: embedding -> blocks (q/k-normed attention, MoE or dense FFN) -> RMSNorm ->
    output.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: Qwen3MoEModelArgs

    def __init__(self, args: Qwen3MoEModelArgs):
        super().__init__(args)
