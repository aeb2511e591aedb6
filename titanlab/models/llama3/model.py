"""Llama 3 decoder-only transformer in plain PyTorch (the shared `Decoder`, Llama's args).

Architecture follows Meta's reference (github.com/meta-llama/llama-models, `models/llama3/model.py`)
and the Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of Models"): pre-norm RMSNorm blocks,
grouped-query attention with interleaved-pair RoPE (Llama 3.1 frequency scaling), SwiGLU,
no biases, head_dim = dim / n_heads.
"""

from __future__ import annotations

from titanlab.models.common.counting import count_params, flops_per_token, get_nparams_and_flops
from titanlab.models.common.decoder import Decoder
from titanlab.models.llama3.args import TransformerModelArgs


class Transformer(Decoder):
    """Llama 3: embedding -> n_layers blocks -> RMSNorm -> output projection.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: TransformerModelArgs

    def __init__(self, args: TransformerModelArgs):
        super().__init__(args)


__all__ = ["Transformer", "count_params", "flops_per_token", "get_nparams_and_flops"]
