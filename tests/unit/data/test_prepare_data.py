import base64
import gzip
import importlib.util
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titanlab.data import prepare
from titanlab.data.prepare import prepare_data
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def write_tiny_model(path):
    """256 single bytes + 3 merges in the Llama 3 tokenizer.model format."""
    tokens = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b"  "]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))
    return str(path)


def make_inputs(root):
    """A .txt, .py, .jsonl, .jsonl.gz and .parquet; returns the documents in prepare's order."""
    root.mkdir()
    (root / "sub").mkdir()
    docs = {}
    docs["a.txt"] = ["Plain text with ünïcode ✓ and <|eot_id|>.\n" * 3]
    (root / "a.txt").write_text(docs["a.txt"][0], encoding="utf-8")
    (root / "sub" / "b.py").write_bytes(b"x = '\xff bad byte'\nprint(x)\n")
    docs["sub/b.py"] = [b"x = '\xff bad byte'\nprint(x)\n".decode("utf-8", errors="replace")]
    docs["c.jsonl"] = ["first json doc", "second — doc", "third doc\nwith lines"]
    (root / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(docs["c.jsonl"])) + "\n\n",
        encoding="utf-8",
    )
    docs["d.jsonl.gz"] = ["gzipped doc one", "gzipped doc two 🎉"]
    with gzip.open(root / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs["d.jsonl.gz"])
    docs["e.parquet"] = ["parquet row 1", "parquet row 2", "def f():\n    return 3\n"]
    pq.write_table(pa.table({"text": docs["e.parquet"] + [None]}), root / "e.parquet")
    (root / ".hidden").write_text("skipped")
    return [t for name in sorted(docs, key=lambda n: str(root / n)) for t in docs[name]]


def expected_tokens(tok, texts):
    return [i for t in texts for i in tok.encode(t, bos=True, eos=True)]


def read_all(out):
    meta = json.loads((out / "metadata.json").read_text())
    arrays = [np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"]]
    return meta, np.concatenate(arrays).tolist()


def test_mixed_inputs(tmp_path):
    texts = make_inputs(tmp_path / "in")
    tok = Tokenizer(default_tokenizer_path())
    out = tmp_path / "out"
    meta = prepare_data(
        [str(tmp_path / "in")],
        str(out),
        default_tokenizer_path(),
        shard_size_mb=1e-4,
        progress=False,
    )
    want = expected_tokens(tok, texts)
    tokens = read_all(out)[1]
    assert tokens == want
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.vocab_size
    assert meta["total_tokens"] == len(want) == sum(s["tokens"] for s in meta["shards"])
    assert meta["total_documents"] == len(texts)
    assert meta["num_shards"] == len(meta["shards"]) > 1
    assert meta["tokenizer_fingerprint"] == tok.fingerprint
    assert (meta["bos_id"], meta["eos_id"]) == (tok.bos_id, tok.eos_id)


def test_resume_redoes_only_missing_shard(tmp_path, monkeypatch):
    make_inputs(tmp_path / "in")
    out = tmp_path / "out"
    args = ([str(tmp_path / "in")], str(out), default_tokenizer_path())
    meta = prepare_data(*args, shard_size_mb=1e-4, progress=False)
    before = {s["file"]: (out / s["file"]).read_bytes() for s in meta["shards"]}
    victim = meta["shards"][1]["file"]
    os.remove(out / victim)

    done = []
    real = prepare._tokenize_shard
    monkeypatch.setattr(
        prepare, "_tokenize_shard", lambda job: done.append(job[2]["index"]) or real(job)
    )
    meta2 = prepare_data(*args, shard_size_mb=1e-4, progress=False)
    assert done == [1]
    assert meta2 == meta
    assert {s["file"]: (out / s["file"]).read_bytes() for s in meta2["shards"]} == before

    done.clear()  # a changed input invalidates only its shard
    with open(tmp_path / "in" / "a.txt", "a") as f:
        f.write("more")
    prepare_data(*args, shard_size_mb=1e-4, progress=False)
    assert done == [0]


def test_parallel_workers_match_serial(tmp_path):
    make_inputs(tmp_path / "in")
    serial = tmp_path / "serial"
    parallel = tmp_path / "parallel"
    for out, workers in ((serial, 1), (parallel, 2)):
        prepare_data(
            [str(tmp_path / "in")],
            str(out),
            default_tokenizer_path(),
            shard_size_mb=1e-4,
            workers=workers,
            progress=False,
        )
    assert read_all(serial) == read_all(parallel)


def test_other_tokenizer_needs_overwrite(tmp_path):
    make_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prepare_data([str(tmp_path / "in")], str(out), default_tokenizer_path(), progress=False)
    tiny = write_tiny_model(tmp_path / "tiny.model")
    with pytest.raises(ValueError, match="--overwrite"):
        prepare_data([str(tmp_path / "in")], str(out), tiny, progress=False)
    meta = prepare_data([str(tmp_path / "in")], str(out), tiny, overwrite=True, progress=False)
    assert meta["tokenizer_fingerprint"] == Tokenizer(tiny).fingerprint
    assert meta["vocab_size"] == 259 + 256


def test_bad_inputs(tmp_path):
    tok = default_tokenizer_path()
    with pytest.raises(FileNotFoundError, match="nothere"):
        prepare_data([str(tmp_path / "nothere")], str(tmp_path / "o1"), tok, progress=False)
    (tmp_path / "x.jsonl").write_text('{"content": "hi"}\n')
    with pytest.raises(ValueError, match="no field 'text'"):
        prepare_data([str(tmp_path / "x.jsonl")], str(tmp_path / "o2"), tok, progress=False)
    meta = prepare_data(
        [str(tmp_path / "x.jsonl")], str(tmp_path / "o3"), tok, text_key="content", progress=False
    )
    assert meta["total_documents"] == 1
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "y.parquet")
    with pytest.raises(ValueError, match="no column 'text'"):
        prepare_data([str(tmp_path / "y.parquet")], str(tmp_path / "o4"), tok, progress=False)


def test_cli(tmp_path):
    path = os.path.join(REPO, "tools", "prepare_data.py")
    spec = importlib.util.spec_from_file_location("prepare_data_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    (tmp_path / "in.txt").write_text("hello cli\n")
    cli.main([str(tmp_path / "in.txt"), "--output", str(tmp_path / "out"), "--workers", "1"])
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["total_documents"] == 1 and meta["num_shards"] == 1
