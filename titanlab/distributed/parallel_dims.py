"""Parallel degrees of a job and the named DeviceMesh they form.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Innermost dims get the
ranks that are closest together (tp inside a node), as in torchtitan and Megatron-LM. Only dims
with degree > 1 are created; the flattened views the parts need are built once and kept:
`dp` (dp_replicate × dp_shard: the data loader), `dp_shard_cp` (FSDP) and `dp_cp` (the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlab.config.job_config import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp"):
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

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Build from the `[parallelism]` config section."""
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
        )

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
    def dp_degree(self) -> int:
        """Number of distinct data streams (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    # --- the mesh ------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh over the current process group and its flattened views.

        Returns the root mesh; `self.mesh(name)` returns a named or flattened sub-mesh.
        """
        degrees = {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }
        names = [n for n in MESH_ORDER if degrees[n] > 1] or ["dp_shard"]
        shape = tuple(degrees[n] for n in names)
        root = init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))
        self._meshes = {"root": root}
        for n in names:
            self._meshes[n] = root[n]
        self._flatten(root, "dp", [n for n in ("dp_replicate", "dp_shard") if n in names])
        self._flatten(root, "dp_shard_cp", [n for n in ("dp_shard", "cp") if n in names])
        self._flatten(root, "dp_cp", [n for n in ("dp_replicate", "dp_shard", "cp") if n in names])
        return root

    def _flatten(self, root: DeviceMesh, name: str, dims: list[str]) -> None:
        # Only the private `_flatten` exists in torch 2.13 (see the project notes); keep the
        # returned mesh ourselves instead of slicing it back out of the root later.
        if len(dims) > 1:
            self._meshes[name] = root[tuple(dims)]._flatten(name)
        elif len(dims) == 1:
            self._meshes[name] = root[dims[0]]

    def mesh(self, name: str) -> DeviceMesh | None:
        """The sub-mesh `name` (pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp, root),
        or None when that parallelism is off (degree 1)."""
        return self._meshes.get(name)

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel streams (0 when dp is off)."""
        m = self.mesh("dp")
        return m.get_local_rank() if m is not None else 0
