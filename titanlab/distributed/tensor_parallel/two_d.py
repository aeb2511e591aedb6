"""2D and 2.5D tensor parallel (`parallelism.tensor_parallel_mode = "2d" | "2.5d"`): the tp ranks
as d stacked q × q grids, every Linear's weight and every activation split on both grid
dimensions, as in Optimus (Xu et al. 2021, arXiv:2104.05343) over SUMMA matrix products (van
de Geijn & Watts 1997); 2.5D (Tesseract, Wang et al. 2021, arXiv:2105.14500) splits the batch
over the d grids too and keeps each grid's weights replicated across them, so weight
gradients are also all-reduced over the depth. 2D is d = 1.

The grid is the 3-D mesh ("tp_depth", "tp_row", "tp_col") over the tp ranks; rank (k, i, j)
holds (placements below are over (tp_row, tp_col), written for d = 1; the depth dim adds an
outer Shard(0) of the batch rows to activations and Replicate() to weights):
- activations between modules (the residual stream): (b/q, s, d/q), the batch rows of grid row
  i and the features of grid column j: DTensor placements [Shard(0), Shard(2)];
- each Linear's weight W (out × in): in-features split over the grid rows, out-features over
  the grid columns: [Shard(1), Shard(0)], 1/q² of it.

A Linear Y = X Wᵀ (`SummaLinear`): X is all-gathered along its grid row (over tp_col) to
[Shard(0), Replicate()] (after a norm it already is), W along its grid column (over tp_row) to
[Replicate(), Shard(0)], and one local matmul gives Y = [Shard(0), Shard(2)], the layout of the
input; `block_comm_bytes` gives one block's volumes. Backward reduce-scatters dX over tp_col and dW over tp_row (the autograd of DTensor's
redistribute). Per layer each rank thus receives (q-1)/q of its grid row's X block and of its
grid column's W block: SUMMA's volume (q broadcasts of one block each, along rows and along
columns) without its step-by-step pipelining.

The rest of the block keeps the model's own code running on local tensors:
- RMSNorm: the features all-gathered along the grid row, normalized with the replicated weight;
  its output, [Shard(0), Replicate()], is what the next Linear's X needs.
- attention: wq / wk / wv give local batch rows × the grid column's heads, so RoPE and SDPA run
  locally (heads and KV heads must split over q columns); wo gathers the heads back.
- embedding (V × d): features split over the grid columns, [Replicate(), Shard(1)]; each rank
  looks up its grid row's batch rows.
- output head: a `SummaLinear` whose logits are gathered over the vocabulary, so rank (i, j)
  holds the logits of batch rows i; `summa_loss` sums the cross-entropy over the grid rows.

Parameters whose gradients come out of DTensor's backward with other placements (partial sums
over the grid rows: the embedding and the norms) are redistributed to their own placements by a
gradient hook, so the optimizer and the gradient norm see one layout.

With data parallel (FSDP, HSDP or DDP over dp ranks outside the grid) the parameters live on
the (dp..., grid...) mesh, replicated over the dp dims, and FSDP2 shards them there
(`fully_shard(..., dp_mesh_dims=...)`, its SPMD-mesh mode): `on_grid` views the gathered
parameter as a DTensor on the grid for the products, and the gradient leaves the grid with the
parameter's own grid placements (the view's backward), for FSDP to reduce over dp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

if TYPE_CHECKING:
    from titanlab.models.common.decoder import Decoder

GRID = ("tp_depth", "tp_row", "tp_col")
# Mesh dims (depth, row, col); depth 1 is 2D. Batch rows over depth, then over tp_row.
ACTIVATIONS = (Shard(0), Shard(0), Shard(2))  # features over tp_col
GATHERED = (Shard(0), Shard(0), Replicate())  # every feature
WEIGHT = (Replicate(), Shard(1), Shard(0))  # in-features over tp_row, out over tp_col
WEIGHT_GATHERED = (Replicate(), Replicate(), Shard(0))  # along the grid column
REPLICATED = (Replicate(), Replicate(), Replicate())


def batch_slice(mesh: DeviceMesh, batch: int, dims: tuple[int, int] = (0, 1)) -> slice:
    """The batch rows this rank holds when they are split over the mesh dims `dims` (outer,
    inner): on the 2D grid block k·q + i of d·q (depth, then grid row); the 3D cube's logits
    use (x, z)."""
    inner = mesh.size(dims[1])
    rows = batch // (mesh.size(dims[0]) * inner)
    block = mesh.get_local_rank(dims[0]) * inner + mesh.get_local_rank(dims[1])
    return slice(block * rows, (block + 1) * rows)


def grid_side(tp: int, depth: int = 1) -> int | None:
    """q with q² · depth = tp, or None when tp / depth is not the square of an integer >= 2."""
    if depth < 1 or tp % depth:
        return None
    q = math.isqrt(tp // depth)
    return q if q >= 2 and q * q * depth == tp else None


def on_grid(param: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`param` (a DTensor on the grid `mesh`, or on a (dp..., grid...) mesh and replicated over
    the dp dims) as a DTensor on `mesh`: its local tensor with its last `mesh.ndim` placements.
    Autograd flows through (the gradient takes the parameter's placements back)."""
    assert isinstance(param, DTensor)
    if param.device_mesh.ndim == mesh.ndim:
        return param
    grid = param.placements[-mesh.ndim :]
    return DTensor.from_local(param.to_local(), mesh, grid, run_check=False)


class SummaLinear(nn.Linear):
    """A bias-free Linear whose weight is a [Shard(1), Shard(0)] DTensor on the grid (see the
    module docstring). Input: a local (b/q, s, in) tensor holding every in-feature
    (`gathered_input`, after a norm) or (b/q, s, in/q) holding grid column j's (after
    attention or the MLP's product); output: local (b/q, s, out/q), or with `gather_output`
    (the head) (b/q, s, out)."""

    gathered_input = True
    gather_output = False

    grid: DeviceMesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.grid
        weight = on_grid(self.weight, mesh)
        if self.gathered_input:
            xd = DTensor.from_local(x, mesh, GATHERED, run_check=False)
        else:
            xd = DTensor.from_local(x, mesh, ACTIVATIONS, run_check=False).redistribute(
                mesh, GATHERED
            )
        w = weight.redistribute(mesh, WEIGHT_GATHERED)
        y = cast(DTensor, F.linear(xd, w))  # [Shard(0), Shard(2)]
        if self.gather_output:
            y = y.redistribute(mesh, GATHERED)
        return y.to_local()


def _same_placements_as(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    assert isinstance(param, DTensor)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            return grad.redistribute(param.device_mesh, param.placements)
        return grad

    return hook


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placements) -> None:
    """Replace parameter `name` of `module` by a DTensor on `mesh` with `placements` over its
    last dims (grid or cube), replicated over any dims before them (dp)."""
    param = getattr(module, name)
    full = (Replicate(),) * (mesh.ndim - len(placements)) + tuple(placements)
    dt = nn.Parameter(distribute_tensor(param.data, mesh, full), requires_grad=param.requires_grad)
    if dt.requires_grad:
        dt.register_hook(_same_placements_as(dt))
    setattr(module, name, dt)


def _grid_norm(norm: nn.RMSNorm, mesh: DeviceMesh, params: DeviceMesh | None = None) -> None:
    """Make `norm` take local (b/q, s, d/q) and return local (b/q, s, d): the features
    all-gathered along the grid row, then normalized with the norm's eps and its replicated
    weight. The 3D cube's residual stream has the same placements (rows over
    its first two dims, features over the third), so it uses this too. `params`: the mesh the
    weight lives on (the grid, or (dp..., grid...) under data parallel)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        xd = DTensor.from_local(x, mesh, ACTIVATIONS, run_check=False)
        weight = on_grid(cast(torch.Tensor, norm.weight), mesh)
        y = F.rms_norm(xd.redistribute(mesh, GATHERED), norm.normalized_shape, weight, norm.eps)
        return cast(DTensor, y).to_local()

    _distribute(norm, "weight", params or mesh, REPLICATED)
    norm.forward = forward  # type: ignore[method-assign]


def _grid_embedding(
    embedding: nn.Module, mesh: DeviceMesh, params: DeviceMesh | None = None
) -> None:
    """Make the token embedding take tokens (b, s), the same on every tp rank, and return the
    grid row's batch rows with the grid column's features, local (b/q, s, d/q)."""
    _distribute(embedding, "weight", params or mesh, (Replicate(), Replicate(), Shard(1)))

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        mine = tokens[batch_slice(mesh, tokens.shape[0])]
        local = DTensor.from_local(mine, mesh, GATHERED, run_check=False)
        weight = on_grid(cast(torch.Tensor, embedding.weight), mesh)
        return cast(DTensor, F.embedding(local, weight)).to_local()  # [Shard(0), Shard(2)]

    embedding.forward = forward  # type: ignore[method-assign]


def _summa_linear(
    linear: nn.Module, mesh: DeviceMesh, params: DeviceMesh, gathered_input: bool
) -> None:
    _distribute(linear, "weight", params, WEIGHT)
    linear.__class__ = SummaLinear
    setattr(linear, "grid", mesh)  # noqa: B010 (instance attributes over the class's)
    setattr(linear, "gathered_input", gathered_input)  # noqa: B010


def apply_tp_2d(model: Decoder, mesh: DeviceMesh, params: DeviceMesh | None = None) -> None:
    """Shard the dense `model` over the q × q `mesh` (dims `GRID`) in place (module docstring).

    Input tokens (b, s) must be identical on every tp rank, b divisible by q; the model's
    forward then returns local logits (b/q, s, vocab) of the grid row's batch rows (`summa_loss`
    turns the loss of those into the whole batch's). `params`: the mesh the parameters live on
    when data parallel shards or replicates them too, (dp..., *GRID), else the grid itself.
    """
    params = params or mesh
    for block in model.layers.values():
        for parent, names, gathered in (
            (block.attention, ("wq", "wk", "wv"), True),
            (block.attention, ("wo",), False),
            (block.feed_forward, ("w1", "w3"), True),
            (block.feed_forward, ("w2",), False),
        ):
            for name in names:
                _summa_linear(getattr(parent, name), mesh, params, gathered)
        _grid_norm(cast(nn.RMSNorm, block.attention_norm), mesh, params)
        _grid_norm(cast(nn.RMSNorm, block.ffn_norm), mesh, params)
    if model.tok_embeddings is not None:
        _grid_embedding(model.tok_embeddings, mesh, params)
    if model.norm is not None:
        _grid_norm(cast(nn.RMSNorm, model.norm), mesh, params)
    if model.output is not None:
        head = cast(nn.Module, model.output)
        _summa_linear(head, mesh, params, gathered_input=True)
        setattr(head, "gather_output", True)  # noqa: B010 (mypy sees the Linear it was)


def sum_over(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """`x` (a plain tensor) summed over mesh dim `dim` (all-reduce; the gradient flows back
    unchanged to every rank). One collective per dim, none for a dim of size 1."""
    if mesh.size(dim) == 1:
        return x
    placements = [Partial() if i == dim else Replicate() for i in range(mesh.ndim)]
    return DTensor.from_local(x, mesh, placements, run_check=False).full_tensor()


def summa_loss(loss_fn: Callable, mesh: DeviceMesh) -> Callable:
    """`loss_fn(logits, labels)` of a 2D / 2.5D-TP model: `logits` the rank's batch rows
    (b/(d·q), s, vocab), `labels` the whole (b, s) batch; the rank's labels are taken
    (`batch_slice`) and the token-loss sums of the d·q row blocks added (a plain 0-dim tensor,
    equal on every tp rank; backward hands each rank the gradient of its own rows)."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        local = loss_fn(logits, labels[batch_slice(mesh, labels.shape[0])])
        return sum_over(sum_over(local, mesh, 1), mesh, 0)  # grid rows, then the depth

    return loss


def block_comm_bytes(
    dim: int, n_heads: int, kv_heads: int, head_dim: int, hidden: int, tokens: int, q: int,
    elem: int = 4, depth: int = 1,
) -> dict[str, int]:  # fmt: skip
    """Bytes one rank communicates for one transformer block's forward and backward under 2D TP
    on a q × q grid (2.5D: `depth` grids), by collective kind, as
    `titanlab.distributed.comm_counter` counts them (the full logical tensor: an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor). `tokens`: b · s of the
    microbatch (each rank holds tokens / (q · depth)); `elem`: bytes per element.

    all_gather: per norm the rank's rows of activations (rows × dim; 2 norms); wo's and w2's
    inputs (rows × heads·head_dim, rows × hidden); every weight along its grid column (in × out
    / q; 7 Linears). reduce_scatter (backward): wo's and w2's input gradients, and every weight
    gradient over the grid row (in × out / q). all_reduce (backward): the input gradients of the
    Linears that read a norm's gathered output (wq, wk, wv, w1, w3: rows × dim each, each
    reduced on its own), and the two norm weights' gradients over the grid rows (dim each);
    with depth > 1 also every weight's shard gradient (in × out / q²) and the norm weights'
    over the depth.
    """
    rows = tokens // (q * depth)
    qkv = [(dim, n_heads * head_dim), (dim, kv_heads * head_dim), (dim, kv_heads * head_dim)]
    linears = [*qkv, (n_heads * head_dim, dim), (dim, hidden), (dim, hidden), (hidden, dim)]
    weights = sum(i * o for i, o in linears)
    over_depth = weights // (q * q) + 2 * dim if depth > 1 else 0
    return {
        "all_gather": elem * (2 * rows * dim + rows * n_heads * head_dim + rows * hidden
                              + weights // q),
        "reduce_scatter": elem * (rows * n_heads * head_dim + rows * hidden + weights // q),
        "all_reduce": elem * (5 * rows * dim + 2 * dim + over_depth),
    }  # fmt: skip
