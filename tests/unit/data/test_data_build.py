"""The run's data from its config (`titanlab.data.build`): one source through [[data.sources]]
is the dataset_path stream; each bad source is one line."""

import json

import numpy as np
import pytest
import torch

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.data.build import build_data, build_loader
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path

TOK = Tokenizer(default_tokenizer_path())


def folder(path, tokens: int, seed: int, **meta) -> str:
    path.mkdir()
    ids = np.random.default_rng(seed).integers(0, 4000, tokens).astype("uint16")
    ids[::50] = TOK.eos_id
    ids.tofile(path / "shard_00000.bin")
    meta = {"dtype": "uint16", "shards": [{"file": "shard_00000.bin", "tokens": tokens}],
            "tokenizer_fingerprint": TOK.fingerprint, "eos_id": TOK.eos_id, **meta}  # fmt: skip
    (path / "metadata.json").write_text(json.dumps(meta))
    return str(path)


def config(*args: str):
    return build_config(["--training.seq_len", "16", "--training.local_batch_size", "4", *args])


def batches(cfg, n: int, dp_rank=0, dp=2):
    data = build_data(cfg, TOK)
    it = iter(build_loader(data.train, cfg, dp_rank, dp, 8, data.schedule))
    return [next(it) for _ in range(n)]


def test_one_source_with_weight_1_is_the_dataset_path_stream(tmp_path):
    path = folder(tmp_path / "web", 3000, 0)
    plain = batches(config("--data.dataset_path", path), 60)  # past an epoch of 186 windows
    mixed = batches(config("--data.sources", f'[{{path = "{path}", weight = 1}}]'), 60)
    for (a, b), (c, d) in zip(plain, mixed):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_a_mixture_reads_every_source(tmp_path):
    web, code = folder(tmp_path / "web", 3000, 0), folder(tmp_path / "code", 2000, 1)
    cfg = config("--data.sources", f'[{{path = "{web}", weight = 3}}, {{path = "{code}"}}]')
    data = build_data(cfg, TOK)
    assert data.train.names == ["web", "code"] and data.val is not None
    assert data.description.startswith("mixture of web (")
    assert len(batches(cfg, 5)) == 5


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"tokenizer_fingerprint": "0123456789abcdef"},
         "data.sources[1].path='{code}' was tokenized with tokenizer 0123456789abcdef"),
        ({"eos_id": 7}, "data.sources end documents with different EOS ids"),
    ],
)  # fmt: skip
def test_a_source_of_another_tokenizer_is_one_line(tmp_path, meta, message):
    web, code = folder(tmp_path / "web", 3000, 0), folder(tmp_path / "code", 2000, 1, **meta)
    cfg = config("--data.sources", f'[{{path = "{web}"}}, {{path = "{code}"}}]')
    with pytest.raises(ConfigError) as e:
        build_data(cfg, TOK)
    assert message.format(code=code) in str(e.value) and "\n" not in str(e.value)


def test_two_sources_named_alike_and_a_missing_folder_are_one_line(tmp_path):
    a = folder(tmp_path / "a", 2000, 0)
    (tmp_path / "b").mkdir()
    b = folder(tmp_path / "b" / "a", 2000, 1)
    with pytest.raises(ConfigError, match="data.sources\\[1\\] is named 'a' like an earlier"):
        build_data(config("--data.sources", f'[{{path = "{a}"}}, {{path = "{b}"}}]'), TOK)
    with pytest.raises(ConfigError, match="data.sources\\[0\\].path='/nope' is not a directory"):
        build_data(config("--data.sources", '[{path = "/nope"}]'), TOK)
