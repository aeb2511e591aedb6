"""What masked attention keeps beyond a traced causal block, for the memory estimator
(`titanlab.planning.memory`): the masks a forward builds (document masks, and under context
parallel the windows and sinks of local attention too) and what titanlab's context-parallel
attention keeps per block. Units: bytes.

The masks depend on the kernel (`titanlab.models.common.document_mask.attention_masks`, by the
device): on CUDA FlexAttention block masks, (S_q/128) × (S_k/128) tiles in four int32 tables
(the key tiles of each query tile, partial and full, and their transposes for backward); on the
CPU dense bool masks of S_q × S_k. The traced block covers the rest (the activation trace runs
the same kernel: FlexAttention's stand-in keeps q, k, v, the output and the log-sum-exp).
"""

from __future__ import annotations

from titanlab.config.job_config import JobConfig

TILE = 128
"""FlexAttention's tile (`titanlab.models.common.flex_masks.BLOCK`)."""


def mask_bytes(q_len: int, kv_len: int, mb: int, flex: bool) -> int:
    """Bytes of one (q_len × kv_len) attention mask of `mb` sequences: FlexAttention's four
    int32 tile tables (`flex`), else a dense bool mask."""
    if not flex:
        return mb * q_len * kv_len
    nq, nk = -(-q_len // TILE), -(-kv_len // TILE)
    return 4 * 4 * mb * nq * nk


def _chat(config: JobConfig) -> bool:
    """`validate.packed_chat_data`, False where the data cannot be read: the loader names that
    with its own line when the run starts."""
    from titanlab.planning.validate import packed_chat_data

    try:
        return packed_chat_data(config)
    except ValueError:
        return False


def cp_attention_bytes(
    config: JobConfig, model_args, mb: int, s: int, cp: int, tp: int, elem: int,
    device_type: str = "cpu",
) -> tuple[int, int]:  # fmt: skip
    """(mask bytes, bytes per block) that masked attention keeps per microbatch on one rank
    beyond the traced causal block, for a run on `device_type`.

    Masks, built once per forward: with documents on one rank, one per forward (FlexAttention's
    on CUDA, one per window kind; the dense one elsewhere); under titanlab's context-parallel
    attention (`titanlab.distributed.context_parallel.documents`: documents, local attention, or
    Ulysses under cp > 1), one per window kind (S/cp × S for ring, S × S for Ulysses; none for
    Ulysses without documents or windows). A block that keeps its activations (AC none, op-level
    selective) also keeps the other ranks' all-gathered keys and values (ring allgather:
    2·(cp−1)·S/cp·H/tp·d elements) or the ring's fp32 output and log-sum-exp (ring alltoall:
    S/cp·H/tp·(dv + 1) fp32); Ulysses keeps as many attention inputs as the traced block
    (H/cp heads over the whole sequence). (0, 0) when PyTorch's causal ring runs or nothing is
    masked."""
    from titanlab.models.common.decoder import has_local_attention, layer_window

    p = config.parallelism
    flex = device_type == "cuda"
    local = has_local_attention(model_args)
    kinds = len({layer_window(model_args, i) for i in range(model_args.n_layers)})  # of windows
    if cp == 1:
        documents = config.data.document_mask or (config.data.packing and _chat(config))
        if documents:  # the Decoder's: flex per window kind on CUDA, one dense mask else
            return (kinds * mask_bytes(s, s, mb, True) if flex else mask_bytes(s, s, mb, False)), 0
        return (kinds * mask_bytes(s, s, mb, True) if flex and local else 0), 0
    documents = config.data.document_mask or (config.data.packing and _chat(config))
    ulysses = p.context_parallel_mode == "ulysses"
    if not (documents or ulysses or local):
        return 0, 0
    rows = s if ulysses else s // cp
    windows = {layer_window(model_args, i) for i in range(model_args.n_layers)}
    if ulysses and not documents and not flex:
        windows.discard(None)  # causal SDPA needs no mask there
    mask = len(windows) * mask_bytes(rows, s, mb, flex) if documents or local else 0
    width = getattr(model_args, "qk_head_dim", model_args.head_dim)
    heads = mb * (s // cp) * (model_args.n_heads // tp)
    if ulysses:
        return mask, 0
    if p.context_parallel_rotate_method == "allgather":
        return mask, 2 * (cp - 1) * heads * width * elem
    return mask, heads * (getattr(model_args, "v_head_dim", width) + 1) * 4
