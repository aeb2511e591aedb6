import json
import os
import threading

from titanlab.data import default_corpus
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path


def test_default_corpus_files_are_stdlib_py():
    files = default_corpus.default_corpus_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f.split(os.sep) for f in files)
    assert any(f.endswith(os.sep + "json" + os.sep + "__init__.py") for f in files)


def test_default_cache_dir(monkeypatch):
    monkeypatch.setenv("TITANLAB_CACHE", "/some/where")
    assert default_corpus.default_cache_dir() == "/some/where"
    monkeypatch.delenv("TITANLAB_CACHE")
    assert default_corpus.default_cache_dir().endswith(os.path.join(".cache", "titanlab"))


def test_ensure_default_corpus_concurrent(tmp_path, monkeypatch):
    stdlib = default_corpus.default_corpus_files()
    few = [
        f
        for f in stdlib
        if f.endswith(
            (os.sep + "json" + os.sep + "encoder.py", os.sep + "json" + os.sep + "decoder.py")
        )
    ]
    monkeypatch.setattr(default_corpus, "default_corpus_files", lambda: few)
    calls = []
    real = default_corpus.prepare_data
    monkeypatch.setattr(
        default_corpus, "prepare_data", lambda *a, **k: calls.append(1) or real(*a, **k)
    )

    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                default_corpus.ensure_default_corpus(str(tmp_path), default_tokenizer_path())
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fingerprint = Tokenizer(default_tokenizer_path()).fingerprint
    assert results == [str(tmp_path / f"stdlib-{fingerprint}")] * 3
    assert len(calls) == 1
    meta = json.loads((tmp_path / f"stdlib-{fingerprint}" / "metadata.json").read_text())
    assert meta["total_documents"] == 2
