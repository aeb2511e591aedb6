"""The deepseek_v3 family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_flavors
from titanlab.models.deepseek_v3.hf import HF
from titanlab.models.deepseek_v3.model import DeepSeekV3Transformer
from titanlab.models.registry import ModelFamily


def flops_per_token(args: DeepSeekV3ModelArgs, seq_len: int, n_params_non_embedding: int) -> int:
    """Training (forward + backward) FLOPs per token: 6 * N + 6 * L * H * (Dqk + Dv) * T.

    N: the (active) parameters without the embedding table, L: n_layers, H: n_heads, Dqk:
    qk_nope_head_dim + qk_rope_head_dim, Dv: v_head_dim, T: seq_len. 6N is the matmul cost
    (Kaplan et al. 2020); the attention term counts the score matmul (width Dqk) and the value
    matmul (width Dv) at 2 FLOPs per multiply-add, 3x for forward + backward, no causal
    discount (PaLM's 12 * L * H * Q * T when Dqk = Dv = Q; Chowdhery et al. 2022, Appendix B).
    MLA's latent projections are in N.
    """
    attention = 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * n_params_non_embedding + attention


FAMILY = ModelFamily(
    name="deepseek_v3",
    description=(
        "DeepSeek-V3 (multi-head latent attention; dense first blocks, then shared + "
        "group-limited sigmoid-routed experts)"
    ),
    args_cls=DeepSeekV3ModelArgs,
    flavors=deepseek_v3_flavors,
    model_cls=DeepSeekV3Transformer,
    flops_per_token=flops_per_token,
    hf=HF,
)
