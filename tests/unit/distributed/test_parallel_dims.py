"""ParallelDims constructor: dp_shard=-1 resolution and one-line layout errors (no mesh built)."""

import pytest

from titanlab.config.job_config import ConfigError, Parallelism
from titanlab.distributed.parallel_dims import ParallelDims


def dims(world_size, dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1) -> ParallelDims:
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size
    )


def dims_error(world_size, **degrees) -> str:
    with pytest.raises(ConfigError) as info:
        dims(world_size, **degrees)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "world, degrees, dp_shard",
    [
        (1, {}, 1),
        (8, {}, 8),
        (8, {"dp_replicate": 2}, 4),
        (8, {"tp": 2}, 4),
        (16, {"dp_replicate": 2, "cp": 2, "pp": 2}, 2),
    ],
)
def test_dp_shard_minus_one_takes_the_rest(world, degrees, dp_shard):
    assert dims(world, **degrees).dp_shard == dp_shard


def test_degree_properties():
    d = dims(8, dp_replicate=2)
    assert (d.dp_degree, d.dp_enabled, d.fsdp_enabled, d.dp_replicate_enabled) == (
        8,
        True,
        True,
        True,
    )
    single = dims(1)
    assert (single.dp_degree, single.dp_enabled, single.fsdp_enabled) == (1, False, False)


def test_from_config():
    p = Parallelism(data_parallel_replicate_degree=2, data_parallel_shard_degree=-1)
    d = ParallelDims.from_config(p, world_size=4)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.world_size) == (2, 2, 1, 1, 1, 4)


def test_product_mismatch_names_numbers_and_world_size():
    assert dims_error(8, dp_shard=3) == (
        "dp_replicate*dp_shard*cp*tp*pp = 1*3*1*1*1 = 3 does not equal the world size 8"
    )
    assert dims_error(4, dp_shard=4, dp_replicate=2) == (
        "dp_replicate*dp_shard*cp*tp*pp = 2*4*1*1*1 = 8 does not equal the world size 4"
    )


def test_world_not_divisible_by_other_degrees():
    assert dims_error(6, dp_replicate=4) == (
        "world size 6 is not divisible by dp_replicate*cp*tp*pp = 4*1*1*1 = 4"
    )


@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp"])
def test_degree_zero(name):
    assert dims_error(4, **{name: 0}) == f"{name}=0 must be >= 1"


@pytest.mark.parametrize("dp_shard", [0, -2])
def test_dp_shard_zero_or_negative(dp_shard):
    assert dims_error(4, dp_shard=dp_shard) == f"dp_shard={dp_shard} must be -1 or >= 1"


@pytest.mark.parametrize("dp_shard", [1, -1])
def test_replicate_without_shard_is_plain_ddp(dp_shard):
    dims = ParallelDims(dp_replicate=2, dp_shard=dp_shard, cp=1, tp=1, pp=1, world_size=2)
    assert (dims.dp_shard, dims.dp_degree, dims.fsdp_enabled, dims.dp_replicate_enabled) == (
        1,
        2,
        False,
        True,
    )


@pytest.mark.parametrize(
    "world, degrees, ep, in_ep, efsdp",
    [
        (4, {}, 2, 2, 2),  # EP 2 × FSDP 2: experts sharded over efsdp
        (4, {}, 4, 4, 1),
        (4, {"tp": 2}, 2, 1, 2),  # ep = tp: nothing borrowed from dp_shard
        (8, {"tp": 2}, 4, 2, 2),
        (8, {"dp_replicate": 2}, 2, 2, 2),
    ],
)
def test_ep_borrows_from_dp_shard_cp_tp(world, degrees, ep, in_ep, efsdp):
    d = ParallelDims(
        **{"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, **degrees},
        world_size=world,
        ep=ep,
    )
    assert (d.dp_shard_in_ep, d.efsdp, d.ep_enabled) == (in_ep, efsdp, True)


@pytest.mark.parametrize(
    "world, degrees, ep",
    [(4, {"tp": 2}, 1 * 3), (4, {"tp": 4}, 2), (8, {"tp": 2}, 8 * 2)],
)
def test_ep_that_does_not_fit_is_one_line(world, degrees, ep):
    with pytest.raises(ConfigError, match="expert_parallel_degree=") as info:
        ParallelDims(
            **{"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, **degrees},
            world_size=world,
            ep=ep,
        )
    assert "\n" not in str(info.value)


def _groups(world: int, name: str, **degrees) -> set[tuple[int, ...]]:
    """The rank groups of sub-mesh `name` over every rank (a fake process group per rank)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlab.distributed.init import destroy_distributed

    groups = set()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            d = ParallelDims(
                **{"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, **degrees},
                world_size=world,
            )
            d.build_mesh("cpu")
            mesh = d.mesh(name)
            assert mesh is not None
            groups.add(tuple(mesh.mesh.flatten().tolist()))
        finally:
            destroy_distributed(barrier=False)  # a fake group: no peers to wait for
    return groups


def test_ep_and_efsdp_meshes_hold_the_expected_ranks():
    # 8 ranks, tp 2, ep 4: ep = 2 dp_shard ranks × the 2 tp ranks, contiguous; efsdp strides.
    assert _groups(8, "ep", tp=2, ep=4) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert _groups(8, "efsdp", tp=2, ep=4) == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert _groups(8, "dp_shard", tp=2, ep=4) == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert _groups(8, "dp_cp_tp", pp=2, ep=2) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    # HSDP × EP: ep inside each replica.
    assert _groups(8, "ep", dp_replicate=2, ep=2) == {(0, 1), (2, 3), (4, 5), (6, 7)}


def test_efsdp_ep_is_a_flattened_mesh_of_every_rank_holding_part_of_an_expert():
    """`efsdp_ep` = efsdp × ep, flattened even where efsdp is 1 rank (DTensor reduces the expert
    gradients' norm over it in one all_reduce, test_grad_norm.py), and the flattened mesh
    already built over the same ranks where there is one (no second process group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlab.distributed.init import destroy_distributed

    assert _groups(2, "efsdp_ep", ep=2) == {(0, 1)}
    assert _groups(4, "efsdp_ep", dp_replicate=2, ep=2) == {(0, 1), (2, 3)}
    assert _groups(8, "efsdp_ep", dp_replicate=2, ep=2) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert _groups(8, "efsdp_ep", tp=2, ep=4) == {tuple(range(8))}
    assert _groups(8, "efsdp_ep", pp=2, ep=2) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    for world, degrees, same_as in ((2, {}, None), (4, {}, "dp_shard"), (4, {"tp": 2}, "dp_cp_tp")):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            d = ParallelDims(**{"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1,
                                **degrees}, world_size=world, ep=2)  # fmt: skip
            root = d.build_mesh("cpu")
            mesh = d.mesh("efsdp_ep")
            assert any(mesh is m for m in root._flatten_mapping.values())
            assert same_as is None or mesh is d.mesh(same_as)
        finally:
            destroy_distributed(barrier=False)  # a fake group: no peers to wait for


def test_a_second_mesh_in_one_process_is_the_one_its_dtensors_carry():
    """A mesh built again in the same process (the warm ranks, a notebook) compares equal to
    the first; DTensor's cached op results carried the first mesh object to the second run's
    parameters (`nn.Parameter(dtensor)`), and FSDP2 over 2D TP's (dp, grid) mesh refused them
    ("different mesh objects"). build_mesh empties those caches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlab.distributed.init import destroy_distributed

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        for _ in range(2):
            d = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=4, pp=1, world_size=8,
                             tp_grid=2, tp_depth=1)  # fmt: skip
            d.build_mesh("cpu")
            mesh = d.mesh("dp_tp_grid")
            with torch.device("meta"):
                weight = torch.empty(4, 4)
            placements = (Replicate(), Replicate(), Shard(1), Shard(0))
            param = torch.nn.Parameter(distribute_tensor(weight, mesh, placements))
            assert param.device_mesh is mesh
    finally:
        destroy_distributed(barrier=False)  # a fake group: no peers to wait for
