import json
import pickle

import numpy as np
import pytest
import torch

from titanlab.data.dataset import MemmapTokenDataset
from titanlab.data.loader import build_dataloader
from titanlab.data.sampler import DistributedShuffleSampler


def write_stream(out, shard_sizes, dtype="uint16"):
    """Shards holding the token stream 0, 1, 2, ... split at ``shard_sizes``."""
    out.mkdir()
    shards, start = [], 0
    for i, n in enumerate(shard_sizes):
        np.arange(start, start + n, dtype=dtype).tofile(out / f"shard_{i:05d}.bin")
        shards.append({"file": f"shard_{i:05d}.bin", "tokens": n, "documents": 1})
        start += n
    meta = {"format_version": 1, "dtype": dtype, "total_tokens": start, "shards": shards}
    (out / "metadata.json").write_text(json.dumps(meta))
    return str(out)


def test_windows_shift_and_cross_shards(tmp_path):
    data = write_stream(tmp_path / "d", [7, 13, 0, 5, 30])  # 55 tokens, an empty shard too
    ds = MemmapTokenDataset(data, 4, val_fraction=0.1)
    assert ds.total_tokens == 55
    assert ds.num_train_windows + ds.num_val_windows == 54 // 4 == 13
    assert ds.num_val_windows == 2 and len(ds) == 11
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4,)
        assert x.tolist() == list(range(4 * i, 4 * i + 4))  # windows 1, 4, 5 cross shard ends
        assert y.tolist() == list(range(4 * i + 1, 4 * i + 5))
    assert ds[-1][0].tolist() == ds[len(ds) - 1][0].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_train_val_disjoint(tmp_path):
    data = write_stream(tmp_path / "d", [100, 101])
    train = MemmapTokenDataset(data, 8, split="train", val_fraction=0.05)
    val = MemmapTokenDataset(data, 8, split="val", val_fraction=0.05)
    assert len(val) == 2 and len(train) == 200 // 8 - 2
    train_starts = {train[i][0][0].item() for i in range(len(train))}
    val_starts = [val[i][0][0].item() for i in range(len(val))]
    assert val_starts == [8 * len(train), 8 * (len(train) + 1)]
    assert not train_starts & set(val_starts)
    assert (
        train[len(train) - 1][1][-1].item() == val[0][0][0].item()
    )  # only the boundary token is shared
    assert val[1][1][-1].item() <= 200


def test_dataset_errors(tmp_path):
    data = write_stream(tmp_path / "d", [10])
    with pytest.raises(ValueError, match="10 tokens.*seq_len=8"):
        MemmapTokenDataset(data, 8)
    with pytest.raises(ValueError, match="val_fraction > 0"):
        MemmapTokenDataset(data, 2, split="val", val_fraction=0.0)
    with pytest.raises(ValueError, match="split='test'"):
        MemmapTokenDataset(data, 2, split="test")
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        MemmapTokenDataset(str(tmp_path), 2)


def test_dataset_pickles_without_data(tmp_path):
    data = write_stream(tmp_path / "d", [5000])
    ds = MemmapTokenDataset(data, 16)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 5000
    assert pickle.loads(blob)[3][0].tolist() == ds[3][0].tolist()


def test_sampler_ranks_disjoint_and_cover_epoch():
    n, world = 23, 4
    samplers = [
        DistributedShuffleSampler(n, dp_rank=r, dp_world_size=world, seed=7) for r in range(world)
    ]
    epoch0 = [[i for _, i in zip(range(n // world), iter(s))] for s in samplers]
    flat = [i for rank in epoch0 for i in rank]
    assert len(flat) == len(set(flat)) == (n // world) * world
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    assert sorted(flat) == sorted(perm[: (n // world) * world])
    assert epoch0[1] == perm[1 : (n // world) * world : world]
    again = DistributedShuffleSampler(n, dp_rank=1, dp_world_size=world, seed=7)
    it = iter(again)
    first_two_epochs = [next(it) for _ in range(2 * (n // world))]
    assert first_two_epochs[: n // world] == epoch0[1]
    assert first_two_epochs[n // world :] != epoch0[1]  # reshuffled with seed + 1
    other = DistributedShuffleSampler(n, dp_rank=1, dp_world_size=world, seed=8)
    assert [i for _, i in zip(range(n // world), iter(other))] != epoch0[1]
    ordered = DistributedShuffleSampler(n, dp_rank=1, dp_world_size=world, seed=0, shuffle=False)
    assert [i for _, i in zip(range(5), iter(ordered))] == [1, 5, 9, 13, 17]


def test_sampler_state_and_errors():
    s = DistributedShuffleSampler(10, dp_rank=0, dp_world_size=2, seed=3)
    it = iter(s)
    [next(it) for _ in range(7)]
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    expected = [next(it) for _ in range(6)]
    fresh = DistributedShuffleSampler(10, dp_rank=0, dp_world_size=2, seed=3)
    fresh.load_state_dict(state)
    assert [i for _, i in zip(range(6), iter(fresh))] == expected
    with pytest.raises(ValueError, match="seed=3 but this sampler has 4"):
        DistributedShuffleSampler(10, dp_rank=0, dp_world_size=2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_rank=2"):
        DistributedShuffleSampler(10, dp_rank=2, dp_world_size=2, seed=0)
    with pytest.raises(ValueError, match="num_samples=1"):
        DistributedShuffleSampler(1, dp_rank=0, dp_world_size=2, seed=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_is_exact(tmp_path, num_workers):
    ds = MemmapTokenDataset(
        write_stream(tmp_path / "d", [40, 50]), 4, val_fraction=0.0
    )  # 22 windows
    kwargs = dict(local_batch_size=3, dp_rank=1, dp_world_size=2, seed=5, num_workers=num_workers)
    loader = build_dataloader(ds, **kwargs)
    it = iter(loader)
    seen = [next(it) for _ in range(5)]
    x, y = seen[0]
    assert x.shape == y.shape == (3, 4) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    state = loader.state_dict()
    reference = [next(it) for _ in range(6)]  # runs past the 11-sample epoch of this rank
    resumed = build_dataloader(ds, **kwargs)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    for want in reference:
        got = next(it2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    del it, it2


def _take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_sampler_reshards_to_another_world_size():
    # 2 ranks take 4 samples each (a global batch of 8); resumed on 4 ranks and on 1 rank, the
    # next global batch of 8 holds the same samples as it would have on the original 2 ranks.
    n = 64
    old = [DistributedShuffleSampler(n, dp_rank=r, dp_world_size=2, seed=5) for r in range(2)]
    for s in old:
        _take(s, 4)
    state = old[0].state_dict()
    want = {i for s in old for i in _take(s, 4)}
    for world in (4, 1, 8):
        new = [
            DistributedShuffleSampler(n, dp_rank=r, dp_world_size=world, seed=5)
            for r in range(world)
        ]
        for s in new:
            s.load_state_dict(dict(state))
        got = [i for s in new for i in _take(s, 8 // world)]
        assert len(got) == 8 and set(got) == want
    odd = dict(state, position=3)  # 6 samples consumed cannot be split over 4 ranks
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        DistributedShuffleSampler(n, dp_rank=0, dp_world_size=4, seed=5).load_state_dict(odd)
