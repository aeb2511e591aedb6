"""gpt-oss decoder in plain PyTorch: the shared `Decoder` whose blocks have biased attention
with sinks, sliding or full (`common/local_attention.py`), and an MoE of clamped-SwiGLU experts
(`common/experts.py`). After Hugging Face's `GptOssForCausalLM` and the gpt-oss model card."""

from __future__ import annotations

from titanlab.models.common.decoder import Decoder
from titanlab.models.gpt_oss.args import GptOssModelArgs


class GptOssTransformer(Decoder):
    """gpt-oss: embedding -> blocks (attention with sinks, sliding or full; MoE) -> RMSNorm ->
    output.

    Raises:
        ValueError: from `args.validate()` if the arguments are inconsistent.
    """

    args: GptOssModelArgs

    def __init__(self, args: GptOssModelArgs):
        super().__init__(args)
