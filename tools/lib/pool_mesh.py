"""DTensor's sharding propagation kept warm across the jobs of a `tools.lib.rank_pool` worker.

DTensor caches each op's sharding (`ShardingPropagator.propagate_op_sharding`, keyed by the op's
argument specs) for the life of the process; the first step of a job pays the uncached
propagation of every op (8.9 % of the warm ranks' samples in a whole integration stage, py-spy,
2-core Xeon VM). A cached output spec holds the device mesh of the job that filled the entry,
and a mesh compares equal to any other of the same ranks, shape and dimension names; a later
job's equal query would get the earlier job's mesh back, whose process groups were destroyed
(or, since c10d numbers groups afresh after `destroy_process_group`, whose group names now name
the later job's groups, perhaps others). So a worker used to empty the cache after every job.

`MeshAliases` keeps the cache and makes every mesh of an earlier job an alias of the first
equal mesh a later job creates: the old object's attribute dict becomes the new mesh's (the same
dict object, so what torch sets on the new mesh after `__init__`, a submesh's group names say,
shows through both). A cache hit can only return meshes equal to one in its query, which was
created in this job, so every mesh it returns names this job's process groups. At the end of a
job every mesh drops its process-group objects (`_pg_registry`); a mesh that no later job
recreates is never returned by a hit, and would fail loudly ("could not resolve the process
group") rather than reach another job's group.

Source: `torch/distributed/device_mesh.py` (`__init__`, `_hash_key`, `__eq__`, `_pg_registry`)
and `torch/distributed/tensor/_sharding_prop.py` (`LocalLRUCache`) of torch 2.13.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

__all__ = ["MeshAliases"]


class MeshAliases:
    """Installed once per worker (`install`); `end_job` after each job."""

    def __init__(self) -> None:
        self._earlier: dict[Any, list[weakref.ref]] = {}
        self._this_job: list[weakref.ref] = []
        self.aliased = 0
        """Meshes of earlier jobs made aliases of a new one (for the pool's tests)."""

    def install(self) -> None:
        """Wrap `DeviceMesh.__init__` so that each new mesh takes over its earlier equals."""
        from torch.distributed.device_mesh import DeviceMesh

        init = DeviceMesh.__init__
        if getattr(init, "_pool_mesh_aliases", None) is not None:
            return

        @functools.wraps(init)
        def aliasing_init(mesh: Any, *args: Any, **kwargs: Any) -> None:
            init(mesh, *args, **kwargs)
            self._created(mesh)

        aliasing_init._pool_mesh_aliases = self  # type: ignore[attr-defined]
        DeviceMesh.__init__ = aliasing_init  # type: ignore[method-assign]

    def _created(self, mesh: Any) -> None:
        for ref in self._earlier.get(mesh._hash_key(), ()):
            old = ref()
            if old is not None and old.__dict__ is not mesh.__dict__:
                old.__dict__ = mesh.__dict__
                self.aliased += 1
        self._this_job.append(weakref.ref(mesh))

    def end_job(self) -> None:
        """Move this job's meshes among the earlier ones and drop every live mesh's process
        groups (destroyed with the job)."""
        for ref in self._this_job:
            mesh = ref()
            if mesh is not None:
                self._earlier.setdefault(mesh._hash_key(), []).append(ref)
        self._this_job = []
        for key, refs in list(self._earlier.items()):
            alive = [ref for ref in refs if ref() is not None]
            if alive:
                self._earlier[key] = alive
            else:
                del self._earlier[key]
            for ref in alive:
                mesh = ref()
                if mesh is not None:
                    mesh.__dict__["_pg_registry"] = {}
