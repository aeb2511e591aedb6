"""Measure the communication of one training step per rank and check it against closed forms.

    python tools/comm_bytes.py [--layouts "FSDP 2,TP 2"] [--dataset DIR] [--no-write]

For each layout it launches the real trainer under torchrun (gloo, `debugmodel_deep`, seq 64,
local batch 2, 2 steps) with `TITANLAB_COMM_COUNT` set, so every rank writes the calls and
bytes of each collective kind of step 2 (`titanlab/distributed/comm_counter.py` defines
"bytes"). `predict` gives the same numbers from the model dims and the layout alone; the
table of both replaces the block between the markers in docs/parallelism.md (unless
--no-write). The formulas are explained in that document.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "parallelism.md")
BEGIN, END = "<!-- comm-table:begin (tools/comm_bytes.py) -->", "<!-- comm-table:end -->"
FLAVOR, SEQ, LOCAL_BS, MICROBATCH, STEPS = "debugmodel_deep", 64, 2, 1, 2
F32 = 4  # bytes per element: parameters, gradients and activations are fp32 on CPU
F64 = 8  # the grad norm accumulates in float64 on CPU


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one measured run (cp is always 1: CUDA only)."""

    name: str
    nproc: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    loss_parallel: bool = True

    def overrides(self) -> list[str]:
        p = "--parallelism."
        return [
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
    """Shape of a parameter on one tp rank under titanlab's plan (tensor_parallel.py)."""
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
    from titanlab.components import build_meta_model
    from titanlab.distributed.pipeline import stage_fqns

    model = build_meta_model(args)
    b, s, d, V, tp = LOCAL_BS, SEQ, args.dim, args.vocab_size, lay.tp
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
    n_shard, fsdp = lay.dp_shard, lay.dp_shard > 1
    if fsdp:
        reshard = lay.pp == 1  # parallelize.reshard_policy("default")
        for unit in shapes:
            count = n_blocks if unit == "block" else 1
            size = _fsdp_bytes(shapes[unit], n_shard)
            terms.append(Term("all_gather", f"FSDP {unit} params, forward", count, size, n_shard))
            if reshard and unit != "norm+output":
                terms.append(
                    Term("all_gather", f"FSDP {unit} params, backward", count, size, n_shard)
                )
            terms.append(Term("reduce_scatter", f"FSDP {unit} grads", count, size, n_shard))
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
    dp = lay.dp_replicate * lay.dp_shard
    if dp > 1:
        terms.append(Term("all_reduce", "token count and loss sum over dp", 2, F32, dp))
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


def histogram(terms: list[Term]) -> dict[str, dict[str, int]]:
    """{kind: {"<bytes>x<group>": calls}}, the form comm_counter writes in `sizes`."""
    out: dict[str, Counter] = {}
    for t in terms:
        out.setdefault(t.kind, Counter())[f"{t.nbytes}x{t.group}"] += t.calls
    return {k: dict(v) for k, v in out.items()}


def make_dataset(out: str) -> str:
    """A ~50k-token prepared dataset (10 stdlib email modules, bundled tokenizer) at `out`."""
    from titanlab.data.default_corpus import default_corpus_files
    from titanlab.data.prepare import prepare_data
    from titanlab.data.tokenizer import default_tokenizer_path

    if not os.path.exists(os.path.join(out, "metadata.json")):
        files = [f for f in default_corpus_files() if os.sep + "email" + os.sep in f][:10]
        prepare_data(
            files, out, default_tokenizer_path(), workers=1, shard_size_mb=0.25, progress=False
        )
    return out


def measure(lay: Layout, dataset: str, workdir: str, timeout: int = 600) -> list[dict]:
    """Run 2 steps of `lay` with the counter on; return each rank's step-2 `kinds` dict.

    Raises RuntimeError with the run's output tail when the run fails."""
    prefix = os.path.join(workdir, lay.name.replace(" ", "_").replace("×", "x").replace(",", ""))
    for old in glob.glob(prefix + ".rank*.json"):
        os.remove(old)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TITANLAB_COMM_COUNT=prefix)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={lay.nproc}",
        "-m",
        "titanlab.train",
        "--job.config_file",
        os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--model.flavor",
        FLAVOR,
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        str(LOCAL_BS),
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--data.dataset_path",
        dataset,
        "--job.dump_folder",
        prefix + "_dump",
        "--comm.init_timeout_seconds",
        "120",
        "--comm.train_timeout_seconds",
        "120",
        *lay.overrides(),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{lay.name}: trainer exited {proc.returncode}:\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-2000:]}"
        )
    ranks = []
    for r in range(lay.nproc):
        with open(f"{prefix}.rank{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f)["kinds"])
    return ranks


def table_rows(lay: Layout, measured: list[dict], args) -> list[tuple]:
    """(layout, ranks, kind, calls measured/predicted, measured bytes, predicted bytes, ratio,
    measured ring wire bytes, every size equal) rows; ranks with equal numbers are shown once."""
    groups: dict[str, list[int]] = {}
    for r, kinds in enumerate(measured):
        key = json.dumps([kinds, histogram(predict(lay, args, r))], sort_keys=True)
        groups.setdefault(key, []).append(r)
    rows = []
    for key, ranks in groups.items():
        kinds, _ = json.loads(key)
        terms = predict(lay, args, ranks[0])
        pred_hist = histogram(terms)
        label = "all" if len(ranks) == lay.nproc else ",".join(map(str, ranks))
        for kind in sorted(set(kinds) | set(pred_hist)):
            m = kinds.get(kind, {"calls": 0, "bytes": 0, "sizes": {}})
            pc = sum(t.calls for t in terms if t.kind == kind)
            pb = sum(t.calls * t.nbytes for t in terms if t.kind == kind)
            ratio = m["bytes"] / pb if pb else float("nan")
            rows.append(
                (
                    lay.name,
                    label,
                    kind,
                    f"{m['calls']}/{pc}",
                    m["bytes"],
                    pb,
                    ratio,
                    m.get("wire_bytes", 0),
                    m["sizes"] == pred_hist.get(kind, {}),
                )
            )
    return rows


def format_table(rows: list[tuple]) -> str:
    lines = [
        "| layout | ranks | kind | calls measured/predicted | bytes measured | bytes predicted"
        " | ratio | every call's size as predicted | ring bytes sent (measured) |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for name, ranks, kind, calls, mb, pb, ratio, wire, same in rows:
        lines.append(
            f"| {name} | {ranks} | {kind} | {calls} | {mb:,} | {pb:,} | {ratio:.3f} | "
            f"{'yes' if same else 'NO'} | {wire:,} |"
        )
    return "\n".join(lines)


def write_doc(table: str) -> None:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    ap.add_argument(
        "--dataset", default="", help="prepared dataset (default: a small one made here)"
    )
    ap.add_argument("--workdir", default="", help="where runs write (default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help=f"do not update {DOC}")
    opts = ap.parse_args()
    wanted = [n.strip() for n in opts.layouts.split(",") if n.strip()]
    unknown = set(wanted) - {lay.name for lay in LAYOUTS}
    if unknown:
        ap.error(f"unknown layouts {sorted(unknown)}; choose from {[l.name for l in LAYOUTS]}")
    workdir = opts.workdir or tempfile.mkdtemp(prefix="comm_bytes_")
    dataset = opts.dataset or make_dataset(os.path.join(workdir, "data"))
    args, rows = model_args(), []
    for lay in LAYOUTS:
        if not wanted or lay.name in wanted:
            rows += table_rows(lay, measure(lay, dataset, workdir), args)
            print(f"measured {lay.name}", file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table)
    if not opts.no_write and not wanted:
        write_doc(table)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
