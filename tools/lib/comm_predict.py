"""Closed forms of the communication one rank issues in one training step, per layout.

`predict(layout, model_args, rank)` lists the collectives as `Term`s (kind, count, bytes per
call, group size) from the model dims and the layout alone; `tools/comm_bytes.py` checks them
against what `titanlab/distributed/comm_counter.py` measures. docs/parallelism.md explains each
formula and its source.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

FLAVOR, SEQ, LOCAL_BS, MICROBATCH, STEPS = "debugmodel_deep", 64, 2, 1, 2
F32 = 4  # bytes per element: parameters, gradients and activations are fp32 on CPU
F64 = 8  # the grad norm accumulates in float64 on CPU


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one measured run."""

    name: str
    nproc: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    loss_parallel: bool = True
    cp: int = 1
    cp_rotate: str = "allgather"
    zero_stage: int = 3
    grad_accum: int = 1  # microbatches per step (FSDP or DDP alone)

    def overrides(self) -> list[str]:
        p = "--parallelism."
        global_batch = LOCAL_BS * self.dp_replicate * self.dp_shard * self.grad_accum
        return [
            p + "zero_stage",
            str(self.zero_stage),
            "--training.global_batch_size",
            str(global_batch),
            p + "data_parallel_replicate_degree",
            str(self.dp_replicate),
            p + "data_parallel_shard_degree",
            str(self.dp_shard),
            p + "tensor_parallel_degree",
            str(self.tp),
            p + "pipeline_parallel_degree",
            str(self.pp),
            p + "pipeline_parallel_schedule",
            "1F1B",
            p + "pipeline_parallel_microbatch_size",
            str(MICROBATCH),
            p + "disable_loss_parallel",
            str(not self.loss_parallel).lower(),
            p + "context_parallel_degree",
            str(self.cp),
            p + "context_parallel_rotate_method",
            self.cp_rotate,
        ]


LAYOUTS = [
    Layout("FSDP 2", 2, dp_shard=2),
    Layout("FSDP 4", 4, dp_shard=4),
    Layout("FSDP 3", 3, dp_shard=3),  # 64 rows over 3 ranks: exercises FSDP2's dim-0 padding
    Layout("HSDP 2×2", 4, dp_replicate=2, dp_shard=2),
    Layout("TP 2", 2, tp=2),
    Layout("TP 2, no loss parallel", 2, tp=2, loss_parallel=False),
    Layout("FSDP 2 × TP 2", 4, dp_shard=2, tp=2),
    Layout("PP 2 (1F1B)", 2, pp=2),
    Layout("PP 2 × FSDP 2", 4, dp_shard=2, pp=2),
    Layout("CP 2 (allgather)", 2, cp=2),
    Layout("CP 2 (alltoall)", 2, cp=2, cp_rotate="alltoall"),
    Layout("CP 2 × TP 2 (alltoall)", 4, cp=2, tp=2, cp_rotate="alltoall"),
    *(
        Layout(f"ZeRO-{stage}, dp 2, grad accum 2", 2, dp_shard=2, zero_stage=stage, grad_accum=2)
        for stage in (0, 1, 2, 3)
    ),
]


@dataclass(frozen=True)
class Term:
    """`calls` collectives of one kind, each of `nbytes` (comm_counter's definition) over a
    group of `group` ranks; `what` says where they come from."""

    kind: str
    what: str
    calls: int
    nbytes: int
    group: int


def model_args():
    """The measured model's dims (vocab from the bundled tokenizer)."""
    from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
    from titanlab.models.llama3 import llama3_flavors

    vocab = Tokenizer(default_tokenizer_path()).vocab_size
    return dataclasses.replace(llama3_flavors[FLAVOR], vocab_size=vocab, max_seq_len=SEQ)


def _tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of a parameter on one tp rank under titanlab's plan (tensor_parallel/one_d.py)."""
    leaf = name.split(".")[-2]  # the module owning the parameter: "wq", "norm", ...
    if leaf in ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings"):  # rows sharded
        return (shape[0] // tp, *shape[1:])
    if leaf in ("wo", "w2"):  # columns sharded
        return (shape[0], shape[1] // tp)
    return shape  # RMSNorm weights: replicated


def _fsdp_bytes(shapes: list[tuple[int, ...]], n: int) -> int:
    """Bytes of one FSDP2 unit's all-gather output: each parameter's dim 0 padded to a multiple
    of the shard degree n (FSDP2 shards dim 0 in equal chunks), fp32."""
    total = 0
    for shape in shapes:
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-shape[0] // n) * n * rest
    return total * F32


def predict(lay: Layout, args, rank: int) -> list[Term]:
    """The collectives rank `rank` issues in one training step of `lay` (grad accumulation 1,
    1F1B with one stage per rank, fp32), as closed-form terms. See docs/parallelism.md."""
    from titanlab.components.builders import build_meta_model
    from titanlab.distributed.pipeline import stage_fqns

    model = build_meta_model(args)
    b, d, V, tp, cp = LOCAL_BS, args.dim, args.vocab_size, lay.tp, lay.cp
    s = SEQ // cp  # this rank's sequence shard
    pp_rank = rank // (lay.nproc // lay.pp)
    fqns = (
        stage_fqns(args.n_layers, lay.pp)[pp_rank]
        if lay.pp > 1
        else ["tok_embeddings", *(f"layers.{i}" for i in range(args.n_layers)), "norm", "output"]
    )
    n_blocks = sum(f.startswith("layers.") for f in fqns)
    first, last = "tok_embeddings" in fqns, "output" in fqns
    # FSDP units (parallelize.apply_fsdp): each block, the embedding, norm + output together.
    units = [("block", [f"layers.{f.split('.')[1]}"]) for f in fqns if f.startswith("layers.")]
    units += [("embedding", ["tok_embeddings"])] if first else []
    units += [("norm+output", ["norm", "output"])] if last else []
    shapes = {u: [] for u, _ in units}
    params = 0
    for unit, mods in units:
        unit_shapes = [
            _tp_local(f"{m}.{n}", tuple(p.shape), tp)
            for m in mods
            for n, p in model.get_submodule(m).named_parameters()
        ]
        shapes[unit] = unit_shapes  # blocks are identical: the last one stands for all
        params += len(unit_shapes)
    terms: list[Term] = []
    # Pipeline: the microbatches each rank's forward and backward run over.
    n_fwd, fb = (b // MICROBATCH, MICROBATCH) if lay.pp > 1 else (1, b)
    ga, stage = lay.grad_accum, lay.zero_stage
    assert ga == 1 or (lay.pp == tp == cp == 1), "grad accumulation: FSDP or DDP alone"
    if stage == 0:  # DDP: the dp_shard ranks replicate; one all-reduce per unit per step
        replicas = lay.dp_replicate * lay.dp_shard
        # `replicate` per block, then the root: embedding, norm and output together
        block = _fsdp_bytes(shapes["block"], 1)
        root = sum(_fsdp_bytes(shapes[u], 1) for u in shapes if u != "block")
        terms.append(Term("all_reduce", "DDP block grads", n_blocks, block, replicas))
        terms.append(Term("all_reduce", "DDP root grads (embedding, norm, output)", 1, root,
                          replicas))  # fmt: skip
    # FSDP shards over dp_shard × cp (the `dp_shard_cp` mesh).
    n_shard = lay.dp_shard * cp
    fsdp = n_shard > 1 and stage != 0
    if fsdp:
        # ZeRO-3: gathered for each microbatch's forward and (resharded after forward but
        # under PP, parallelize.reshard_policy) again for its backward, grads reduce-scattered
        # per microbatch. ZeRO-2: gathered once per step, kept; grads per microbatch. ZeRO-1:
        # gathered once, grads reduce-scattered once.
        reshard = lay.pp == 1 and stage == 3
        gathers = ga if stage == 3 else 1
        scatters = 1 if stage == 1 else ga
        for unit in shapes:
            count = n_blocks if unit == "block" else 1
            size = _fsdp_bytes(shapes[unit], n_shard)
            terms.append(
                Term("all_gather", f"FSDP {unit} params, forward", count * gathers, size, n_shard)
            )
            if reshard and unit != "norm+output":
                terms.append(
                    Term("all_gather", f"FSDP {unit} params, backward", count * ga, size, n_shard)
                )
            terms.append(
                Term("reduce_scatter", f"FSDP {unit} grads", count * scatters, size, n_shard)
            )
            if lay.dp_replicate > 1:
                terms.append(
                    Term(
                        "all_reduce",
                        f"HSDP {unit} grad shards",
                        count,
                        size // n_shard,
                        lay.dp_replicate,
                    )
                )
    if tp > 1:
        act = fb * s * d * F32  # one (mb, seq, dim) activation, gathered size
        k = 4 * n_blocks * n_fwd  # 2 per block in forward, 2 mirrored in backward
        terms += [
            Term("all_gather", "TP/SP block inputs of attention and FFN (fwd + bwd)", k, act, tp),
            Term("reduce_scatter", "TP/SP block outputs of wo and w2 (fwd + bwd)", k, act, tp),
        ]
        if first:
            terms += [
                Term("reduce_scatter", "TP embedding output, forward", n_fwd, act, tp),
                Term("all_gather", "TP embedding output grad, backward", n_fwd, act, tp),
            ]
        if last:
            terms += [
                Term("all_gather", "TP output-projection input, forward", n_fwd, act, tp),
                Term("reduce_scatter", "TP output-projection input grad, backward", n_fwd, act, tp),
            ]
            if lay.loss_parallel:
                terms.append(
                    Term(
                        "all_reduce",
                        "loss parallel: max, sum-exp, target logit",
                        3 * n_fwd,
                        fb * s * F32,
                        tp,
                    )
                )
            else:
                terms.append(
                    Term("all_gather", "TP full-vocab logits", n_fwd, fb * s * V * F32, tp)
                )
        norms = 2 * n_blocks + int(last)
        again = 1 if fsdp else 2  # Partial norm grads: FSDP reduces once; else clip and AdamW each
        terms.append(
            Term("all_reduce", "SP RMSNorm weight grads (Partial)", norms * again, d * F32, tp)
        )
    # Grad norm: the vector of per-parameter norms (float64 on CPU) is all-reduced once over
    # the ranks that shard the gradients (dp_shard × tp together under FSDP × TP).
    shard_ranks = (n_shard if fsdp else 1) * tp
    if shard_ranks > 1:
        terms.append(
            Term("all_reduce", "grad-norm: per-parameter norms", 1, params * F64, shard_ranks)
        )
    if cp > 1:
        terms += _ring_terms(lay, args, n_blocks * n_fwd, fb * s)
    dp_cp = lay.dp_replicate * lay.dp_shard * cp
    if dp_cp > 1:
        terms.append(Term("all_reduce", "token count and loss sum over dp × cp", 2, F32, dp_cp))
    if lay.pp > 1:
        terms.append(Term("all_reduce", "loss sum over pp", 1, F32, lay.pp))
        terms.append(Term("all_reduce", "grad-norm² over pp (float64 on CPU)", 1, F64, lay.pp))
        msg = MICROBATCH * (s // tp) * d * F32
        m = b // MICROBATCH
        if not last:
            terms += [
                Term("send", "PP activations to the next stage", m, msg, lay.pp),
                Term("recv", "PP gradients from the next stage", m, msg, lay.pp),
            ]
        if not first:
            terms += [
                Term("recv", "PP activations from the previous stage", m, msg, lay.pp),
                Term("send", "PP gradients to the previous stage", m, msg, lay.pp),
            ]
    return terms


def _ring_terms(lay: Layout, args, calls: int, tokens: int) -> list[Term]:
    """Ring attention (torch's context parallel, `_templated_ring_attention` and its backward)
    over the cp group: `calls` attention calls of `tokens` local tokens each. The key and value
    shards travel together: kv = 2 · tokens · (heads / tp) · head_dim · 4 bytes (GQA's KV heads
    are repeated before SDPA). Forward: `allgather` gathers all cp shards once, `alltoall`
    passes them cp − 1 times round the ring (each a `permute_tensor`, an all-to-all that sends
    the whole buffer to the next rank). Backward: the same again for the kv, plus cp ring passes
    of the kv gradients (always all-to-all, fp32 accumulators)."""
    n = lay.cp
    kv = 2 * tokens * (args.n_heads // lay.tp) * (args.dim // args.n_heads) * F32
    grads = Term("all_to_all", "CP ring: kv gradients, backward", calls * n, kv, n)
    if lay.cp_rotate == "allgather":
        return [Term("all_gather", "CP ring: kv shards (fwd + bwd)", 2 * calls, n * kv, n), grads]
    return [Term("all_to_all", "CP ring: kv shards (fwd + bwd)", 2 * calls * (n - 1), kv, n), grads]


def param_bytes(args, modules: tuple[str, ...] = ()) -> int:
    """Ψ: the fp32 bytes of the model's parameters (those under `modules` when given)."""
    from titanlab.components.builders import build_meta_model

    model = build_meta_model(args)
    return sum(
        p.numel() * F32
        for n, p in model.named_parameters()
        if not modules or n.split(".")[0] in modules
    )


def parameter_traffic(kinds: dict) -> int:
    """What ZeRO's §7 counts of one rank's step (`kinds` as comm_counter writes them): the
    bytes all-gathered and reduce-scattered, and twice those all-reduced (a ring all-reduce is
    a reduce-scatter then an all-gather), the (n − 1) / n of a ring left out as the paper does.
    The token count and the grad-norm all-reduces are a few hundred bytes of it."""
    return sum(
        kinds.get(kind, {}).get("bytes", 0) * weight
        for kind, weight in (("all_gather", 1), ("reduce_scatter", 1), ("all_reduce", 2))
    )


def histogram(terms: list[Term]) -> dict[str, dict[str, int]]:
    """{kind: {"<bytes>x<group>": calls}}, the form comm_counter writes in `sizes`."""
    out: dict[str, Counter] = {}
    for t in terms:
        out.setdefault(t.kind, Counter())[f"{t.nbytes}x{t.group}"] += t.calls
    return {k: dict(v) for k, v in out.items()}
