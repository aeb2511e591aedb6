"""The sample stream (`titanlab.data.mixture`): one source is the single-dataset order; the
shares of a mixture follow the weights and the schedule; each source is drawn without
replacement per epoch; ranks split every global batch; a saved state resumes the same stream on
any number of ranks."""

import pytest
import torch

from titanlab.data.mixture import MixtureDataset, MixtureSampler, WeightSchedule


def take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def global_stream(sizes, world, local_batches, batch, **kw):
    """Global batches (sorted flat indices) of `world` ranks taking `local_batches` × `batch`."""
    samplers = [MixtureSampler(sizes, dp_rank=r, dp_world_size=world, seed=5, **kw)
                for r in range(world)]  # fmt: skip
    its = [iter(s) for s in samplers]
    out = []
    for _ in range(local_batches):
        out.append(sorted(i for it in its for i in (next(it) for _ in range(batch))))
    return out, samplers


def test_one_source_is_the_seeded_permutation_split_over_ranks():
    n, world = 23, 4
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    perm1 = torch.randperm(n, generator=torch.Generator().manual_seed(8)).tolist()
    stream = perm + perm1  # epoch 0, then epoch 1 (seed + 1), no tail dropped
    for r in range(world):
        s = MixtureSampler([n], dp_rank=r, dp_world_size=world, seed=7)
        assert take(s, 10) == stream[r : r + 10 * world : world]
    ordered = MixtureSampler([n], dp_rank=1, dp_world_size=world, seed=0, shuffle=False)
    assert take(ordered, 5) == [1, 5, 9, 13, 17]


def test_weights_are_followed_exactly():
    """0.7 / 0.3 over 200 steps of 8 samples: each source within one sample of its share."""
    sched = WeightSchedule([0.7, 0.3])
    s = MixtureSampler([500, 300], dp_rank=0, dp_world_size=1, seed=0, samples_per_step=8,
                       schedule=sched)  # fmt: skip
    flat = take(s, 1600)
    from_second = sum(i >= 500 for i in flat)
    assert abs(from_second - 0.3 * 1600) <= 1 and s.consumed == [1600 - from_second, from_second]
    assert s.consumed_after_step(200) == {"0": 1600 - from_second, "1": from_second}
    assert s.consumed_after_step(100) is not None


def test_each_source_is_drawn_without_replacement_per_epoch():
    s = MixtureSampler([10, 6], dp_rank=0, dp_world_size=1, seed=3,
                       schedule=WeightSchedule([0.5, 0.5]))  # fmt: skip
    flat = take(s, 24)  # 12 from each: one epoch of source 0 (10) + 2, two of source 1
    first = [i for i in flat if i < 10]
    second = [i - 10 for i in flat if i >= 10]
    assert sorted(first[:10]) == list(range(10)) and sorted(second[:6]) == list(range(6))
    assert sorted(second[6:12]) == list(range(6)) and second[:6] != second[6:12]


def test_schedule_moves_the_shares_step_by_step():
    sched = WeightSchedule([1, 1], [(0, [0.9, 0.1]), (100, [0.1, 0.9])])
    assert sched.at(1) == pytest.approx([0.892, 0.108])
    assert sched.at(50) == pytest.approx([0.5, 0.5]) and sched.at(500) == [0.1, 0.9]
    s = MixtureSampler([10_000, 10_000], dp_rank=0, dp_world_size=1, seed=0,
                       samples_per_step=10, schedule=sched)  # fmt: skip
    take(s, 1000)
    early, late = s.consumed_after_step(10), s.consumed_after_step(100)
    assert early["0"] >= 85 and early["1"] <= 15  # ~0.86 of the first 100 samples
    between = {k: late[k] - s.consumed_after_step(90)[k] for k in late}
    assert between["1"] >= 80  # the last 10 steps: ~0.86 from source 1


def test_phase_switch_with_two_points_one_step_apart():
    sched = WeightSchedule([1, 1], [(10, [1, 0]), (11, [0, 1])])
    assert sched.at(10) == [1.0, 0.0] and sched.at(11) == [0.0, 1.0]


@pytest.mark.parametrize("new_world", [1, 2, 4, 8])
def test_resume_continues_the_same_global_batches_on_any_world_size(new_world):
    sizes = [37, 23]
    kw = dict(
        samples_per_step=8, schedule=WeightSchedule([1, 1], [(0, [0.8, 0.2]), (20, [0.2, 0.8])])
    )
    want, _ = global_stream(sizes, 2, 30, 4, **kw)  # 30 steps of 8 on 2 ranks
    _, old = global_stream(sizes, 2, 12, 4, **kw)  # stop after step 12
    state = old[1].state_dict()
    assert state == old[0].state_dict()  # every rank holds the same state
    resumed = [MixtureSampler(sizes, dp_rank=r, dp_world_size=new_world, seed=5, **kw)
               for r in range(new_world)]  # fmt: skip
    for s in resumed:
        s.load_state_dict(dict(state))
    its = [iter(s) for s in resumed]
    per_rank = 8 // new_world
    got = [sorted(i for it in its for i in (next(it) for _ in range(per_rank))) for _ in range(18)]
    assert got == want[12:]


def test_state_mismatch_and_bad_arguments_are_one_line():
    s = MixtureSampler([10, 5], dp_rank=0, dp_world_size=1, seed=3, names=["a", "b"])
    take(s, 3)
    other = MixtureSampler([10, 6], dp_rank=0, dp_world_size=1, seed=3, names=["a", "b"])
    with pytest.raises(ValueError, match=r"sizes=\[10, 5\] but this run has \[10, 6\]"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="dp_rank=2"):
        MixtureSampler([10], dp_rank=2, dp_world_size=2, seed=0)
    with pytest.raises(ValueError, match="must each hold at least one sample"):
        MixtureSampler([10, 0], dp_rank=0, dp_world_size=1, seed=0)
    with pytest.raises(ValueError, match="must be 2 values >= 0, not all 0"):
        WeightSchedule([0, 0])


def test_state_of_the_earlier_single_dataset_sampler_is_read():
    """A checkpoint of the former sampler (epoch, per-rank position) continues the same order
    inside its epoch."""
    old = {"epoch": 0, "position": 3, "num_samples": 20, "dp_world_size": 2, "seed": 4}
    s = MixtureSampler([20], dp_rank=1, dp_world_size=2, seed=4)
    s.load_state_dict(old)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(4)).tolist()
    assert take(s, 3) == perm[7:13:2]


def test_mixture_dataset_maps_flat_indices_to_sources():
    ds = MixtureDataset([list("abc"), list("xy")], ["letters", "tail"])
    assert [ds[i] for i in range(len(ds))] == list("abcxy") and ds.sizes == [3, 2]
    with pytest.raises(IndexError):
        ds[5]
