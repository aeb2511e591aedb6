import json
import pickle

import numpy as np
import pytest
import torch

from titanlab.data.dataset import MemmapTokenDataset
from titanlab.data.loader import build_dataloader


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
    with pytest.raises(FileNotFoundError, match="titanlab prepare-data"):
        MemmapTokenDataset(str(tmp_path), 2)


def test_dataset_pickles_without_data(tmp_path):
    data = write_stream(tmp_path / "d", [5000])
    ds = MemmapTokenDataset(data, 16)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 5000
    assert pickle.loads(blob)[3][0].tolist() == ds[3][0].tolist()


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
