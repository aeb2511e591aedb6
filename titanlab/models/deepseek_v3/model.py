"""DeepSeek-V3 decoder in plain PyTorch (the shared `Decoder` with multi-head latent attention
and, after the first dense blocks, `MoE` blocks with shared experts).

After Hugging Face's `DeepseekV3ForCausalLM` and the DeepSeek-V3 Technical Report
(arXiv:2412.19437): `titanlab.models.common.mla.MLAttention` in every block, group-limited
sigmoid routing with the selection bias in `titanlab.models.common.moe`.
"""

from __future__ import annotations

from titanlab.models.common.decoder import Decoder
from titanlab.models.deepseek_v3.args import DeepSeekV3ModelArgs


class DeepSeekV3Transformer(Decoder):
    """DeepSeek-V3: embedding -> blocks (MLA; dense SwiGLU or MoE) -> RMSNorm -> output.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: DeepSeekV3ModelArgs

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__(args)
