"""Parallel degrees of a job and the named DeviceMesh they form.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Innermost dims get the
ranks that are closest together (tp inside a node), as in torchtitan and Megatron-LM. Only dims
with degree > 1 are created; the flattened views the parts need are built once and kept:
`dp` (dp_replicate × dp_shard: the data loader), `dp_shard_cp` (FSDP), `dp_cp` (the loss) and
`dp_cp_tp` (every rank of a pipeline stage: the ranks that hold different tokens at an MoE
layer, whose load statistics are summed).

Expert parallel (ep > 1) splits dp_shard into two root dims, `efsdp` (outer) and
`dp_shard_in_ep` (inner), so that `ep` = dp_shard_in_ep × cp × tp is a contiguous block of
ranks and `efsdp` (always built, size 1 included) holds the ranks that keep the same experts:
the expert weights are Shard(0) over ep and FSDP-sharded over efsdp (replicated over
dp_replicate under HSDP). `dp_shard` is then the flattened (efsdp, dp_shard_in_ep), and
`efsdp_ep` the flattened (efsdp, ep): every rank holding a different part of an expert's weights.
The expert gradients' norm (`titanlab.distributed.utils.clip_grad_norm_`) is partial over both
dims; DTensor finds the flattened mesh by its ranks and reduces it in one all_reduce, not one
per dim (torch 2.13 warns "2 sequential all_reduce operations" without it).
"""

from __future__ import annotations

import dataclasses

import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlab.config.job_config import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_ORDER = ("pp", "dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")


def check_zero_stage(parallelism, dims: ParallelDims) -> None:
    """The ZeRO stage (`parallelism.zero_stage` or `fsdp_sharding_strategy`) against the
    degrees, before stage 0 turns the dp_shard ranks into replicas. Raises ConfigError (one
    line) for a stage that means nothing on this layout or that it cannot be."""
    stage, strategy = parallelism.zero_stage_in_force, parallelism.fsdp_sharding_strategy
    name = (
        f"parallelism.fsdp_sharding_strategy={strategy}"
        if strategy
        else f"parallelism.zero_stage={stage}"
    )
    if strategy == "HYBRID_SHARD" and (dims.dp_replicate == 1 or dims.dp_shard == 1):
        raise ConfigError(
            f"{name} needs data_parallel_replicate_degree > 1 and data_parallel_shard_degree > 1 "
            f"(HSDP), not {dims.dp_replicate} and {dims.dp_shard}; or use FULL_SHARD"
        )
    if stage == 0:
        if dims.cp > 1 or dims.ep > 1:
            degree = "context_parallel" if dims.cp > 1 else "expert_parallel"
            raise ConfigError(
                f"{name} (DDP, nothing sharded) with parallelism.{degree}_degree="
                f"{dims.cp if dims.cp > 1 else dims.ep} is not supported (its ranks shard the "
                "parameters with FSDP); use zero_stage 1, 2 or 3"
            )
        if dims.dp_replicate * dims.dp_shard == 1:
            raise ConfigError(
                f"{name} (DDP) with no data-parallel ranks (data_parallel_replicate_degree × "
                "data_parallel_shard_degree = 1) means nothing; use zero_stage 3 (the default)"
            )
    if stage in (1, 2) and dims.dp_shard * dims.cp == 1:
        raise ConfigError(
            f"{name} with no ranks to shard over (data_parallel_shard_degree × "
            "context_parallel_degree = 1) shards nothing; use data_parallel_shard_degree > 1 or "
            "zero_stage 3 (the default)"
        )


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave.

    Raises:
        ConfigError: a degree < 1 (other than dp_shard=-1), or degrees whose product is not the
            world size.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    tp_grid: int = field(default=1, repr=False)
    """q of the q × q grids of the tp ranks (2D / 2.5D tensor parallel; mesh `tp_2d`), 1 for 1D."""
    tp_depth: int = field(default=1, repr=False)
    """d, the number of stacked q × q grids (2.5D tensor parallel)."""
    tp_cube: int = field(default=1, repr=False)
    """q of a q × q × q cube of the tp ranks (3D tensor parallel; mesh `tp_3d`), 1 otherwise."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _root_names: dict[str, str] = field(default_factory=dict, repr=False)
    _flat_dims: dict[str, list[str]] = field(default_factory=dict, repr=False)
    """Each flattened mesh's root dims of more than one rank."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp*pp = "
                    f"{self.dp_replicate}*{self.cp}*{self.tp}*{self.pp} = {others}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"dp_shard={self.dp_shard} must be -1 or >= 1")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"dp_replicate*dp_shard*cp*tp*pp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp}*{self.pp} = {product} does not equal the world size {self.world_size}"
            )
        if self.ep > 1:
            inner = self.cp * self.tp
            if self.ep % inner or (self.dp_shard * inner) % self.ep:
                raise ConfigError(
                    f"parallelism.expert_parallel_degree={self.ep} must be a multiple of cp*tp = "
                    f"{inner} and divide dp_shard*cp*tp = {self.dp_shard * inner} (ep is taken "
                    "from the ranks that hold different tokens)"
                )

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Build from the `[parallelism]` config section. At ZeRO stage 0 (DDP) the dp_shard
        ranks replicate instead: dp_replicate × dp_shard replicas, dp_shard 1."""
        dims = cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
            ep=parallelism.expert_parallel_degree,
        )
        mode = parallelism.tensor_parallel_mode
        if mode in ("2d", "2.5d"):
            from titanlab.distributed.tensor_parallel.two_d import grid_side

            depth = parallelism.tensor_parallel_depth
            side = grid_side(dims.tp, depth)
            if side is None:
                raise ConfigError(
                    f"parallelism.tensor_parallel_mode={mode} needs tensor_parallel_degree = q² "
                    f"× tensor_parallel_depth ({depth}) with q an integer >= 2 (e.g. "
                    f"{4 * depth}, {9 * depth}), not {dims.tp}"
                )
            dims.tp_grid, dims.tp_depth = side, depth
        elif mode == "3d":
            from titanlab.distributed.tensor_parallel.three_d import cube_side

            cube = cube_side(dims.tp)
            if cube is None:
                raise ConfigError(
                    f"parallelism.tensor_parallel_mode=3d needs tensor_parallel_degree = q³ with "
                    f"q an integer >= 2 (8, 27, ...), not {dims.tp}"
                )
            dims.tp_cube = cube
        check_zero_stage(parallelism, dims)
        if parallelism.zero_stage_in_force == 0 and dims.dp_shard > 1:
            dims = dataclasses.replace(
                dims, dp_replicate=dims.dp_replicate * dims.dp_shard, dp_shard=1
            )
        return dims

    # --- which parallelisms are on -------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard × cp (cp ranks hold different tokens of the same samples)."""
        return self.dp_shard * self.cp > 1

    @property
    def fsdp2_managed(self) -> bool:
        """FSDP2 owns the parameters (`fully_shard` for FSDP/HSDP, its `replicate` for DDP): it
        casts them for mixed precision and their gradients are DTensors."""
        return self.fsdp_enabled or self.dp_replicate_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of ep taken from dp_shard (ep / (cp × tp)); 1 without ep."""
        return self.ep // (self.cp * self.tp) if self.ep_enabled else 1

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them: dp_shard / dp_shard_in_ep."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def dp_degree(self) -> int:
        """Number of distinct data streams (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    # --- the mesh ------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh over the current process group and its flattened views.

        Returns the root mesh; `self.mesh(name)` returns a named or flattened sub-mesh.

        DTensor's sharding-propagation caches are emptied first: a mesh compares equal to an
        earlier one over the same ranks and names, and a cached op result (even
        `nn.Parameter(dtensor)`) would carry that earlier mesh object, which FSDP2's
        `dp_mesh_dims` mode refuses ("different mesh objects") and whose process groups may be
        gone: a second run in one process (a notebook, the tests' warm ranks) meets it.
        """
        _clear_sharding_caches()
        degrees = {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "efsdp": self.efsdp,
            "dp_shard_in_ep": self.dp_shard_in_ep,
            "cp": self.cp,
            "tp": self.tp,
        }
        if self.ep_enabled:
            names = [n for n in EP_MESH_ORDER if degrees[n] > 1 or n == "efsdp"]
            shard = [n for n in ("efsdp", "dp_shard_in_ep") if degrees[n] > 1]
        else:
            names = [n for n in MESH_ORDER if degrees[n] > 1] or ["dp_shard"]
            shard = [n for n in ("dp_shard",) if n in names]
        shape = tuple(degrees[n] for n in names)
        root = init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))
        self._meshes = {"root": root}
        self._root_names = {}
        self._flat_dims = {}
        for n in names:
            self._meshes[n] = root[n]
        rep = [n for n in ("dp_replicate",) if n in names]
        cp = [n for n in ("cp",) if n in names]
        tp = [n for n in ("tp",) if n in names]
        self._flatten(root, "dp_shard", shard)
        self._flatten(root, "dp", rep + shard)
        self._flatten(root, "dp_shard_cp", shard + cp)
        self._flatten(root, "dp_cp", rep + shard + cp)
        self._flatten(root, "dp_cp_tp", rep + shard + cp + tp)
        if self.ep_enabled:
            ep: list[str] = [n for n in ("dp_shard_in_ep", "cp", "tp") if n in names]
            self._flatten(root, "ep", ep)
            self._flatten_expert_shard(root, ["efsdp", *ep])
        if self.tp_grid > 1 or self.tp_cube > 1:
            self._build_tp_grid(root, [n for n in ("dp_replicate", "dp_shard") if n in names])
        return root

    def _build_tp_grid(self, root: DeviceMesh, dp: list[str]) -> None:
        """The tp ranks as 2D / 2.5D grids (`tp_2d`) or a 3D cube (`tp_3d`); with data parallel
        also `dp_tp_grid`, the (dp..., grid...) mesh the parameters live on (FSDP2 shards them
        over its dp dims)."""
        from titanlab.distributed.tensor_parallel.two_d import GRID
        from titanlab.distributed.tensor_parallel.three_d import CUBE

        if self.tp_grid > 1:
            name, sizes, dims = "tp_2d", (self.tp_depth, self.tp_grid, self.tp_grid), GRID
        else:
            name, sizes, dims = "tp_3d", (self.tp_cube,) * 3, CUBE
        if not dp:
            self._meshes[name] = self._meshes["tp"]._unflatten(0, sizes, dims)
            return
        full = root._unflatten("tp", sizes, dims)
        self._meshes[name] = full[dims]
        self._meshes["dp_tp_grid"] = full[(*dp, *dims)]

    def _flatten(self, root: DeviceMesh, name: str, dims: list[str]) -> None:
        # Only the private `_flatten` exists in torch 2.13 (see the project notes); keep the
        # returned mesh ourselves instead of slicing it back out of the root later.
        if name in self._meshes:  # a root dim already
            self._root_names[name] = name
            return
        if len(dims) > 1:
            self._meshes[name] = root[tuple(dims)]._flatten(name)
            self._root_names[name] = name
            self._flat_dims[name] = [n for n in dims if self._meshes[n].size() > 1]
        elif len(dims) == 1:
            self._meshes[name] = root[dims[0]]
            self._root_names[name] = dims[0]

    def _flatten_expert_shard(self, root: DeviceMesh, dims: list[str]) -> None:
        """`efsdp_ep`: the flattened mesh of `dims` (efsdp and ep's root dims), or the flattened
        mesh already built over the same ranks (e.g. `dp_shard` when efsdp > 1, ep from
        dp_shard only), so that no process group is created twice. It is flattened even where
        efsdp is 1: DTensor looks only among the flattened meshes for one to reduce over."""
        wide = [n for n in dims if self._meshes[n].size() > 1]
        for name, flat_dims in self._flat_dims.items():
            if flat_dims == wide:
                self._meshes["efsdp_ep"], self._root_names["efsdp_ep"] = self._meshes[name], name
                return
        self._flatten(root, "efsdp_ep", dims)

    def root_slice(self, *names: str) -> DeviceMesh:
        """The root mesh sliced to the (possibly flattened) dims `names`, e.g. (dp_replicate,
        dp_shard_cp) for HSDP: a multi-dim sub-mesh sharing the root with every other mesh."""
        root = self._meshes["root"]
        dims = tuple(self._root_names.get(n, n) for n in names)
        with warnings.catch_warnings():
            # torch 2.13 warns that slicing a flattened dim from the root "will be deprecated";
            # it offers no other way to build a 2-D mesh with a flattened dim.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return root[dims]

    def mesh(self, name: str) -> DeviceMesh | None:
        """The sub-mesh `name` (pp, dp_replicate, dp_shard, cp, tp, tp_2d, tp_3d, dp_tp_grid, ep,
        efsdp, efsdp_ep, dp, dp_shard_cp, dp_cp, dp_cp_tp, root), or None when that parallelism
        is off (degree 1; `efsdp` and `efsdp_ep` exist whenever ep > 1)."""
        return self._meshes.get(name)

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel streams (0 when dp is off)."""
        m = self.mesh("dp")
        return m.get_local_rank() if m is not None else 0


def _clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches, the C++ fast path's and Python's (torch's
    `torch.distributed.tensor.debug._clear_sharding_prop_cache`, where this torch has it)."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
