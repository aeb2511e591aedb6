"""The tensor-parallel mode table (`python tools/benchmark.py --matrix tp`): 1D, 2D, 2.5D and 3D
tensor parallel at the same degrees (4 and 8 ranks), each measured on spawned gloo ranks.

Per mode: one transformer block's forward + backward communication by collective kind, as
`titanlab/distributed/comm_counter.py` counts it (the logical bytes and what a ring puts on the
wire), taken as the difference between a 2-block and a 1-block model on the same batch, so the
embedding, head and loss drop out; the closed form of each mode beside it (`predicted`); and the
2-block model's loss and worst gradient against one process on the whole batch. The model is
Llama 3's `debugmodel` with 8 KV heads (so 1D splits its heads 8 ways), vocabulary 512,
a microbatch of 8 × 64 tokens, fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass

import torch

BATCH, SEQ, VOCAB = 8, 64, 512


@dataclass(frozen=True)
class Mode:
    """One measured tensor-parallel mode at one degree."""

    mode: str  # 1d | 2d | 2.5d | 3d
    tp: int
    depth: int = 1

    @property
    def side(self) -> int:
        """q: the side of the grid (tp = q²·d) or of the cube (tp = q³); 1 for 1D."""
        from titanlab.distributed.tensor_parallel.two_d import grid_side
        from titanlab.distributed.tensor_parallel.three_d import cube_side

        if self.mode == "1d":
            return 1
        side = cube_side(self.tp) if self.mode == "3d" else grid_side(self.tp, self.depth)
        assert side is not None, self
        return side

    @property
    def name(self) -> str:
        return f"{self.mode}" + (f" (d={self.depth})" if self.depth > 1 else "") + f", tp {self.tp}"


MODES = (Mode("1d", 4), Mode("2d", 4), Mode("1d", 8), Mode("2.5d", 8, 2), Mode("3d", 8))


def model_args(n_layers: int):
    from titanlab.models.llama3 import llama3_flavors

    base = llama3_flavors["debugmodel"]
    return dataclasses.replace(base, vocab_size=VOCAB, n_layers=n_layers, n_kv_heads=8)


def predicted(mode: Mode, elem: int = 4) -> dict[str, int]:
    """The closed form of one block's bytes per collective kind (forward + backward)."""
    from titanlab.distributed.tensor_parallel.one_d import block_comm_bytes as one_d
    from titanlab.distributed.tensor_parallel.two_d import block_comm_bytes as two_d
    from titanlab.distributed.tensor_parallel.three_d import block_comm_bytes as three_d

    a = model_args(1)
    dims = (a.dim, a.n_heads, a.kv_heads, a.head_dim, a.ffn_hidden_dim())
    tokens = BATCH * SEQ
    if mode.mode == "1d":
        return one_d(a.dim, tokens, elem)
    if mode.mode == "3d":
        return three_d(*dims, tokens, q=mode.side, elem=elem)
    return two_d(*dims, tokens, q=mode.side, elem=elem, depth=mode.depth)


def _shard(model, mode: Mode):
    """Shard `model` for `mode` in place; returns the loss wrapper for its outputs."""
    from torch.distributed.device_mesh import init_device_mesh

    if mode.mode == "1d":
        from titanlab.distributed.tensor_parallel.one_d import apply_tp

        mesh = init_device_mesh("cpu", (mode.tp,), mesh_dim_names=("tp",))
        apply_tp(model, mesh, loss_parallel=False)
        return lambda fn: fn
    if mode.mode == "3d":
        from titanlab.distributed.tensor_parallel.three_d import CUBE, apply_tp_3d, cube_loss

        mesh = init_device_mesh("cpu", (mode.side,) * 3, mesh_dim_names=CUBE)
        apply_tp_3d(model, mesh)
        return lambda fn: cube_loss(fn, mesh)
    from titanlab.distributed.tensor_parallel.two_d import GRID, apply_tp_2d, summa_loss

    mesh = init_device_mesh("cpu", (mode.depth, mode.side, mode.side), mesh_dim_names=GRID)
    apply_tp_2d(model, mesh)
    return lambda fn: summa_loss(fn, mesh)


def _worker(rank: int, init_file: str, out: str, mode: Mode) -> None:
    import torch.distributed as dist

    from titanlab.components.loss import cross_entropy_sum
    from titanlab.distributed.comm_counter import CommCounter
    from titanlab.distributed.init import destroy_distributed
    from titanlab.models.registry import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=mode.tp)  # fmt: skip
    ok = False
    try:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        counted, result = {}, {}
        for n_layers in (1, 2):
            torch.manual_seed(0)
            ref = build_model(model_args(n_layers))
            ref.init_weights()
            model = copy.deepcopy(ref)
            wrap = _shard(model, mode)
            want = cross_entropy_sum(ref(tokens), labels)
            want.backward()
            with CommCounter() as counter:
                got = wrap(cross_entropy_sum)(model(tokens), labels)
                got.backward()
            counted[n_layers] = counter.summary()
            worst = 0.0
            for (_, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                worst = max(worst, (grad - p_ref.grad).abs().max().item())
            result = {"loss": [want.item(), got.item()], "worst_grad": worst}
        block = {}
        for kind in set(counted[1]) | set(counted[2]):
            two, one = counted[2].get(kind, {}), counted[1].get(kind, {})
            block[kind] = {
                key: two.get(key, 0) - one.get(key, 0) for key in ("calls", "bytes", "wire_bytes")
            }
            sizes = {
                size: n - one.get("sizes", {}).get(size, 0)
                for size, n in two.get("sizes", {}).items()
            }
            block[kind]["sizes"] = {size: n for size, n in sizes.items() if n}
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump({**result, "block": block}, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def measure(mode: Mode) -> dict:
    """Run `mode` on `mode.tp` spawned ranks; rank 0's result (loss pair, worst gradient
    difference, the block's calls / bytes / wire bytes per kind)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), out, mode), nprocs=mode.tp)
        with open(out, encoding="utf-8") as f:
            return json.load(f)


KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_ARGS = model_args(1)
DESCRIPTION = (
    "One transformer block's forward + backward per rank (Llama 3 debugmodel with 8 KV heads, "
    f"dim {_ARGS.dim}, MLP {_ARGS.ffn_hidden_dim()}, a microbatch of {BATCH} × {SEQ} tokens, "
    "fp32), measured by the "
    "communication counter as a 2-block model's bytes less a 1-block model's; *closed form*: "
    "`block_comm_bytes` of titanlab/distributed/tensor_parallel/one_d.py (1D, Megatron with "
    "sequence parallel), two_d.py (2D / 2.5D) and three_d.py (3D), equal per "
    "kind or the prediction shown; *on the wire*: what each rank sends under a ring "
    "((n-1)/n of an all-gather's output or a reduce-scatter's input, twice that for an "
    "all-reduce, n the group); the loss of the 2-block model against one process on the whole "
    "batch (summed token losses, per token) and its worst gradient difference."
)


def as_predicted(mode: Mode, result: dict) -> bool:
    """Whether every kind's measured bytes equal the closed form."""
    want = predicted(mode)
    return all(result["block"].get(k, {}).get("bytes", 0) == want.get(k, 0) for k in KINDS)


def all_as_predicted(results: dict[Mode, dict]) -> bool:
    """Every mode's bytes as predicted, its loss within 1e-6 per token and gradients 1e-5."""
    return all(
        as_predicted(m, r)
        and abs(r["loss"][1] - r["loss"][0]) / (BATCH * SEQ) < 1e-6
        and r["worst_grad"] < 1e-5
        for m, r in results.items()
    )


def table(results: dict[Mode, dict]) -> str:
    """Markdown: per mode, the measured bytes per kind (= or ≠ the closed form), the wire
    bytes, their ratio to 1D at the same degree, and the loss against one process."""
    rows = [
        "| mode | all-gather KiB | reduce-scatter KiB | all-reduce KiB | closed form "
        "| on the wire KiB | wire / 1D | \\|Δloss\\| / tokens | worst \\|Δgrad\\| |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    wire_1d = {}
    for mode, r in results.items():
        wire = sum(r["block"].get(k, {}).get("wire_bytes", 0) for k in r["block"])
        if mode.mode == "1d":
            wire_1d[mode.tp] = wire
        got = {k: r["block"].get(k, {}).get("bytes", 0) for k in KINDS}
        match = "equal" if as_predicted(mode, r) else f"differs: {predicted(mode)}"
        ratio = f"{wire / wire_1d[mode.tp]:.2f}" if mode.tp in wire_1d else "n/a"
        dloss = abs(r["loss"][1] - r["loss"][0]) / (BATCH * SEQ)
        rows.append(
            f"| {mode.name} | {got['all_gather'] / 1024:,.0f} | "
            f"{got['reduce_scatter'] / 1024:,.0f} | {got['all_reduce'] / 1024:,.1f} | {match} | "
            f"{wire / 1024:,.0f} | {ratio} | {dloss:.1e} | {r['worst_grad']:.1e} |"
        )
    return "\n".join(rows)
