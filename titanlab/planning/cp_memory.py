"""What titanlab's context-parallel attention keeps beyond a traced causal block, for the
memory estimator (`titanlab.planning.memory`). Units: bytes."""

from __future__ import annotations

from titanlab.config.job_config import JobConfig


def cp_attention_bytes(
    config: JobConfig, model_args, mb: int, s: int, cp: int, tp: int, elem: int
) -> tuple[int, int]:
    """(mask bytes, bytes per block) that titanlab's context-parallel attention
    (`titanlab.distributed.cp_documents`: a document mask or Ulysses under cp > 1) keeps
    beyond the traced causal block, per microbatch on one rank. The mask is built once per
    forward (bool: S/cp × S for ring, S × S for Ulysses). A block that keeps its activations
    (AC none, op-level selective) also keeps the other ranks' all-gathered keys and values
    (ring allgather: 2·(cp−1)·S/cp·H/tp·d elements) or the ring's fp32 output and
    log-sum-exp (ring alltoall: S/cp·H/tp·(dv + 1) fp32); Ulysses keeps as many attention
    inputs as the traced block (H/cp heads over the whole sequence). (0, 0) without cp or when
    PyTorch's causal ring runs."""
    from titanlab.planning.validate import packed_chat_data

    p = config.parallelism
    if cp == 1:
        return 0, 0
    documents = config.data.document_mask or (config.data.packing and packed_chat_data(config))
    ulysses = p.context_parallel_mode == "ulysses"
    if not (documents or ulysses):
        return 0, 0
    mask = mb * s * s // (1 if ulysses else cp) if documents else 0
    width = getattr(model_args, "qk_head_dim", model_args.head_dim)
    local = mb * (s // cp) * (model_args.n_heads // tp)
    if ulysses:
        return mask, 0
    if p.context_parallel_rotate_method == "allgather":
        return mask, 2 * (cp - 1) * local * width * elem
    return mask, local * (getattr(model_args, "v_head_dim", width) + 1) * 4
