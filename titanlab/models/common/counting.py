"""Parameter counts and training FLOPs per token of a `Decoder` (or a pipeline stage of one):
what MFU, the memory estimator, the planner and the pipeline split read. Every function works
on the meta device."""

from __future__ import annotations

from torch import nn

from titanlab.models.common.decoder import DecoderArgs, moe_layers


def count_active_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameters one token uses: routed experts count top_k of num_experts (the FLOPs and MFU
    of an MoE model use this); equals `count_params` for a dense model."""
    n = count_params(model, exclude_embedding)
    for moe in moe_layers(model):
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.args.num_experts
        n -= per_expert * (moe.args.num_experts - moe.args.top_k)
    return n


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters; shared (tied) tensors are counted once. Works on the meta device.

    With `exclude_embedding`, the token embedding table is left out (it is a lookup, not a
    matmul) unless it is tied to the output projection, which is a matmul and stays counted.
    """
    n = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    if exclude_embedding and emb is not None and (out is None or out.weight is not emb.weight):
        n -= emb.weight.numel()
    return n


def attention_flops_per_token(args: DecoderArgs, seq_len: int) -> int:
    """Training FLOPs per token of one block's attention: 6 · H · (Dqk + Dv) · T, the score
    (width Dqk) and value (width Dv) matmuls at 2 FLOPs per multiply-add, forward and backward
    (3x), no causal discount (PaLM, Chowdhery et al. 2022, Appendix B: 12·H·Q·T when
    Dqk = Dv = Q = head_dim). Multi-head latent attention's args give `qk_head_dim` and
    `v_head_dim`; its latent projections are ordinary matmuls, counted in the parameters."""
    qk = getattr(args, "qk_head_dim", args.head_dim)
    v = getattr(args, "v_head_dim", args.head_dim)
    return 6 * args.n_heads * (qk + v) * seq_len


def flops_per_token(args: DecoderArgs, seq_len: int, n_params_non_embedding: int) -> int:
    """Training (forward + backward) FLOPs per token: 6 · N + (L + D) · A + 6 · D · V · d.

    N: parameters without the embedding table (the output projection and any multi-token
    prediction depths counted), L: n_layers, A: `attention_flops_per_token`, D: multi-token
    prediction depths (`args.mtp_layers`, 0 for most families), each running one more block
    and the output head (V × d) once more. 6N is the dense matmul cost (2 forward + 4 backward
    per parameter, Kaplan et al. 2020). The q/k norms' elementwise work is not counted (it is
    not a matmul).
    """
    depths = getattr(args, "mtp_layers", 0)
    attention = (args.n_layers + depths) * attention_flops_per_token(args, seq_len)
    head = 6 * depths * args.vocab_size * args.dim
    return 6 * n_params_non_embedding + attention + head


def get_nparams_and_flops(model: nn.Module, args: DecoderArgs, seq_len: int) -> tuple[int, int]:
    """(total parameter count, training FLOPs per token at `seq_len`); see `flops_per_token`."""
    n_non_embedding = count_params(model, exclude_embedding=True)
    return count_params(model), flops_per_token(args, seq_len, n_non_embedding)


def describe_params(model: nn.Module) -> str:
    """The trainer's words for the model's size: "N parameters", with the active ones of an MoE
    model and, for a model with multi-token prediction depths (`model.mtp`, DeepSeek-V3), how
    many of them the depths hold: a published count (671B) leaves them out, since inference
    does not use them."""
    n, active = count_params(model), count_active_params(model)
    words = f"{n:,} parameters" + (f" ({active:,} active per token)" if active != n else "")
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        mtp_n, mtp_active = count_params(mtp), count_active_params(mtp)
        words += f", of them {mtp_n:,}" + (
            f" ({mtp_active:,} active)" if mtp_active != mtp_n else ""
        )
        words += " in the multi-token prediction depths, which inference does not use"
    return words
