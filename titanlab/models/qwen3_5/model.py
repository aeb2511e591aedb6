"""Qwen3.5 hybrid decoder in plain PyTorch (the shared `Decoder`, Qwen3.5's args).

After Hugging Face's `Qwen3_5ForCausalLM` (text part of the Qwen3.5 release, 2026): the args'
`layer_type` gives each block a Gated DeltaNet (`common/linear_attention.py`) or a gated
full attention with partial RoPE and q/k norms (`common/attention.py`); SwiGLU, or for the MoE
variant (`moe_args.py`) routed experts plus a gated shared expert; every RMSNorm zero-centered.
"""

from __future__ import annotations

from titanlab.models.common.decoder import Decoder
from titanlab.models.qwen3_5.args import Qwen35ModelArgs


class Qwen35Transformer(Decoder):
    """Qwen3.5: embedding → blocks (linear or gated full attention) → RMSNorm → output.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: Qwen35ModelArgs

    def __init__(self, args: Qwen35ModelArgs):
        super().__init__(args)
