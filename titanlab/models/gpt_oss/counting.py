"""gpt-oss's training FLOPs per token: a sliding layer's attention is counted over its window.

`common.counting.flops_per_token` charges every block's attention over the whole sequence
(6 · H · 2·head_dim · T, no causal discount). A sliding block's query sees at most W keys, so
here it is charged min(T, W) keys instead; full blocks keep T. The matmuls of the parameters
(6N, with the active experts only) are counted as for every family.
"""

from __future__ import annotations

from titanlab.models.gpt_oss.args import GptOssModelArgs


def gpt_oss_flops_per_token(
    args: GptOssModelArgs, seq_len: int, n_params_non_embedding: int
) -> int:
    """6 · N + Σ_blocks 6 · H · 2·head_dim · (T for full blocks, min(T, W) for sliding ones).

    Args:
        args: the model's shape; seq_len: T, tokens per sequence; n_params_non_embedding: N
            (the active count for MoE, `count_active_params`).
    Returns:
        Training (forward + backward) FLOPs per token.
    """
    keys = sum(
        seq_len if (w := args.layer_window(i)) is None else min(seq_len, w)
        for i in range(args.n_layers)
    )
    return 6 * n_params_non_embedding + 6 * args.n_heads * 2 * args.head_dim * keys
