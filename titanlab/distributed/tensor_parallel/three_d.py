"""3D tensor parallel (`parallelism.tensor_parallel_mode = "3d"`): the tp ranks as a q × q × q cube
(tp = q³), each Linear's weight and activations split over all three dimensions (Bian et al.
2021, "Maximizing Parallelism in Distributed Training for Huge Neural Networks",
arXiv:2105.14450; the 3D matrix product of Agarwal et al. 1995).

The cube is the 3-D mesh ("tp_x", "tp_y", "tp_z") over the tp ranks, coordinates (i, j, l).
A product Y = X Wᵀ contracts over one cube dimension and leaves its output features on
another, so the Linears alternate two kinds and the residual stream keeps one layout:
- residual stream: batch rows split over x then y, features over z: [Shard(0), Shard(0),
  Shard(2)], local (b/q², s, d/q); a norm gathers its features over z.
- kind A (wq, wk, wv, w1, w3, the head: features in over z, out over y): X gathered over y (its
  rows), W (out over x and y, in over z) gathered over x; the local product is a partial sum
  over z, reduce-scattered over z onto X's rows: Y = [Shard(0), Shard(2), Shard(0)], rows
  over x then z, features over y. Attention runs on those local rows and the y-column's heads.
- kind B (wo, w2: features in over y, out over z): X gathered over z, W (out over x and z, in
  over y) gathered over x; the partial sum over y reduce-scattered over y onto the rows gives
  the residual layout back.
Each weight is thus 1/q³ per rank. Backward mirrors each step (DTensor's redistribute
autograd); gradients of the embedding and the norms, partial over the batch dimensions, are
redistributed to their parameters' placements by a hook (as in 2D).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from titanlab.distributed.tensor_parallel.two_d import (
    ACTIVATIONS,
    GATHERED,
    _distribute,
    _grid_embedding,
    _grid_norm,
    batch_slice,
    on_grid,
    sum_over,
)

if TYPE_CHECKING:
    from titanlab.models.common.decoder import Decoder

CUBE = ("tp_x", "tp_y", "tp_z")
RESIDUAL = ACTIVATIONS  # rows over x then y, features over z (the 2D grid's layout)
NORMED = GATHERED
# kind: (X before the product, W stored, W for the product, Y after the reduction)
KINDS = {
    "A": (
        (Shard(0), Replicate(), Shard(2)),
        (Shard(0), Shard(0), Shard(1)),
        (Replicate(), Shard(0), Shard(1)),
        (Shard(0), Shard(2), Shard(0)),
    ),
    "B": (
        (Shard(0), Shard(2), Replicate()),
        (Shard(0), Shard(1), Shard(0)),
        (Replicate(), Shard(1), Shard(0)),
        RESIDUAL,
    ),
}
A_OUT = KINDS["A"][3]


def cube_side(tp: int) -> int | None:
    """q with q³ = tp, or None when tp is not the cube of an integer >= 2."""
    q = round(tp ** (1 / 3))
    return q if q >= 2 and q**3 == tp else None


class CubeLinear(nn.Linear):
    """A bias-free Linear of kind A or B on the cube (module docstring). `input_layout`: the
    placements of its local input (NORMED after a norm, A_OUT after attention or the MLP's
    product); `gather_output` (the head): the logits of the rank's rows over the whole vocab."""

    kind = "A"
    input_layout = NORMED
    gather_output = False
    grid: DeviceMesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.grid
        weight = on_grid(self.weight, mesh)
        x_target, _, w_target, out = KINDS[self.kind]
        xd = DTensor.from_local(x, mesh, self.input_layout, run_check=False)
        y = cast(
            DTensor, F.linear(xd.redistribute(mesh, x_target), weight.redistribute(mesh, w_target))
        )
        if self.gather_output:  # rows over x then z, every vocab entry
            return y.redistribute(mesh, (Shard(0), Replicate(), Shard(0))).to_local()
        return y.redistribute(mesh, out).to_local()


def _cube_linear(
    linear: nn.Module, mesh: DeviceMesh, params: DeviceMesh, kind: str, input_layout
) -> None:
    _distribute(linear, "weight", params, KINDS[kind][1])
    linear.__class__ = CubeLinear
    setattr(linear, "grid", mesh)  # noqa: B010
    setattr(linear, "kind", kind)  # noqa: B010 (instance attributes over the class's)
    setattr(linear, "input_layout", input_layout)  # noqa: B010


def apply_tp_3d(model: Decoder, mesh: DeviceMesh, params: DeviceMesh | None = None) -> None:
    """Shard the dense `model` over the q × q × q `mesh` (dims `CUBE`) in place. Input tokens
    (b, s), the same on every tp rank, b divisible by q²; the forward returns local logits
    (b/q², s, vocab) of the rank's rows over x then z (`cube_loss`). `params`: the mesh the
    parameters live on under data parallel, (dp..., *CUBE), else the cube itself."""
    params = params or mesh
    for block in model.layers.values():
        attention = cast(nn.Module, block.attention)
        mlp = cast(nn.Module, block.feed_forward)
        for name in ("wq", "wk", "wv"):
            _cube_linear(getattr(attention, name), mesh, params, "A", NORMED)
        _cube_linear(cast(nn.Module, attention.wo), mesh, params, "B", A_OUT)
        for name in ("w1", "w3"):
            _cube_linear(getattr(mlp, name), mesh, params, "A", NORMED)
        _cube_linear(cast(nn.Module, mlp.w2), mesh, params, "B", A_OUT)
        _grid_norm(cast(nn.RMSNorm, block.attention_norm), mesh, params)
        _grid_norm(cast(nn.RMSNorm, block.ffn_norm), mesh, params)
    if model.tok_embeddings is not None:  # rows over x then y, features over z
        _grid_embedding(model.tok_embeddings, mesh, params)
    if model.norm is not None:
        _grid_norm(cast(nn.RMSNorm, model.norm), mesh, params)
    if model.output is not None:
        head = cast(nn.Module, model.output)
        _cube_linear(head, mesh, params, "A", NORMED)
        setattr(head, "gather_output", True)  # noqa: B010


def cube_loss(loss_fn, mesh: DeviceMesh):
    """`loss_fn(logits, labels)` of a 3D-TP model: `logits` the rank's rows (over x then z) of
    the batch, `labels` the whole batch; the token-loss sums of the q² row blocks added (a plain
    0-dim tensor, equal on every tp rank)."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        local = loss_fn(logits, labels[batch_slice(mesh, labels.shape[0], (0, 2))])
        return sum_over(sum_over(local, mesh, 2), mesh, 0)

    return loss


def block_comm_bytes(
    dim: int, n_heads: int, kv_heads: int, head_dim: int, hidden: int, tokens: int, q: int,
    elem: int = 4,
) -> dict[str, int]:  # fmt: skip
    """Bytes one rank communicates for one transformer block's forward and backward under 3D
    tensor parallel on a q × q × q cube, by collective kind, as
    `titanlab.distributed.comm_counter` counts them (an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor). `tokens`: b · s of the microbatch; `elem`: bytes per
    element. Every collective runs over one cube dimension (q ranks).

    Per Linear (in i, out o; r = tokens / q, the rows one cube face holds), as DTensor's
    redistributions and the sharding propagation of its products issue them (counted per call
    on a 2 × 2 × 2 cube, tools/benchmark.py --matrix tp):
    - kind A (wq, wk, wv, w1, w3): all-gathers of X-sized r·i/q and r·i, three of Y-sized
      r·o/q and W over x, o·i/q²; reduce-scatters of r·i and two of r·o/q;
    - kind B (wo, w2): all-gathers of three r·i/q, one r·o/q and o·i/q²; reduce-scatters of
      two r·i/q and one r·o/q.
    No weight-sized reduce-scatter: DTensor gathers activations so that each rank's dW comes
    out whole, where the paper's count (Bian et al. 2021) reduce-scatters dW and gathers X and
    dY once each. Each norm all-gathers its input's features
    (tokens/q² × dim) and all-reduces its weight's gradient over x and over y (2 × dim).
    """
    r = tokens // q
    a_kind = [(dim, n_heads * head_dim), (dim, kv_heads * head_dim), (dim, kv_heads * head_dim),
              (dim, hidden), (dim, hidden)]  # fmt: skip
    b_kind = [(n_heads * head_dim, dim), (hidden, dim)]
    gather = 2 * (tokens // (q * q)) * dim  # the two norms
    scatter = 0
    for i, o in a_kind:
        gather += r * i // q + r * i + 3 * r * o // q + o * i // (q * q)
        scatter += r * i + 2 * r * o // q
    for i, o in b_kind:
        gather += 3 * r * i // q + r * o // q + o * i // (q * q)
        scatter += 2 * r * i // q + r * o // q
    return {
        "all_gather": elem * gather,
        "reduce_scatter": elem * scatter,
        "all_reduce": elem * 4 * dim,
    }
