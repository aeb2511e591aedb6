"""The tensor-parallel plan of one decoder block (`titanlab.models.common.decoder`), applied from
outside the model by `titanlab.distributed.tensor_parallel.apply_tp`.

Megatron-LM style (Shoeybi et al. 2019) with sequence parallel (Korthikanti et al. 2022): wq/wk/
wv and w1/w3 column-wise, so attention runs on the local heads; wo and w2 row-wise, their outputs
reduce-scattered onto sequence shards; the block norms normalize each rank's own tokens. The
per-head q/k norms (Qwen3) see (bs, seq, local heads, head_dim): the heads dim (2) is the sharded
one, their weight (head_dim,) is replicated, and their output goes back to a plain tensor for
RoPE. `titanlab.distributed.tensor_parallel.apply_tp` applies this plan to every block.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel


def decoder_block_plan(
    colwise: type, rowwise: type, prepare_input: type, *, qk_norm: bool
) -> dict[str, ParallelStyle]:
    """Module path within a block → parallel style.

    Args:
        colwise, rowwise, prepare_input: the style classes (torch's, or torchao's float8 ones).
        qk_norm: the block's attention has `q_norm` / `k_norm`.
    """
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin): only x is a sharded activation; the RoPE tables are plain tensors.
        "attention": prepare_input(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
    }
    if qk_norm:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan
