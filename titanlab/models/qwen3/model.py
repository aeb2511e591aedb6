"""Qwen3 dense decoder in plain PyTorch (the shared `Decoder`, Qwen3's args).

Architecture after the Qwen3 Technical Report (Yang et al. 2025) and Hugging Face's
`Qwen3ForCausalLM`: Llama's pre-norm blocks with GQA and SwiGLU, plus an RMSNorm over head_dim
on every query and key head before RoPE (`q_norm` / `k_norm`, one weight of head_dim shared by
the heads), an explicit head_dim, rope_theta 1e6, no attention bias, and tied embeddings on the
small sizes.
"""

from __future__ import annotations

from titanlab.models.common.decoder import Decoder
from titanlab.models.qwen3.args import Qwen3ModelArgs


class Qwen3Transformer(Decoder):
    """Qwen3: embedding -> n_layers blocks (q/k-normed attention) -> RMSNorm -> output.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: Qwen3ModelArgs

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(args)
