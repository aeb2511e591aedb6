"""The activation traces kept on disk: computed once per machine, whichever process asks first,
traced anew when the source changes or the file is damaged, and never a reason for a run to
fail."""

import dataclasses
import multiprocessing
import os
import time

import pytest
import torch

from titanlab.models.llama3 import llama3_flavors
from titanlab.planning import activation_memory, trace_cache
from titanlab.planning.activation_memory import trace_activation_bytes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "traces"
    monkeypatch.setenv(trace_cache.ENV, str(folder))
    return folder


def _slow_square(log: str, x: int) -> int:
    with open(log, "a") as f:
        f.write("computed\n")
    time.sleep(0.5)  # long enough for the other process to ask meanwhile
    return x * x


def _ask(folder: str, log: str, out: str) -> None:
    os.environ[trace_cache.ENV] = folder
    value = trace_cache.remembered("square 7", lambda: _slow_square(log, 7))
    with open(out, "w") as f:
        f.write(str(value))


def test_two_processes_asking_at_once_compute_once(cache, tmp_path):
    log = str(tmp_path / "log")
    ctx = multiprocessing.get_context("spawn")
    outs = [str(tmp_path / f"out{i}") for i in range(2)]
    procs = [ctx.Process(target=_ask, args=(str(cache), log, out)) for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert open(log).read() == "computed\n"
    assert [open(o).read() for o in outs] == ["49", "49"]


def test_a_changed_source_or_a_damaged_file_computes_again(cache, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"one": [1, 2, 3]}

    assert trace_cache.remembered("k", compute) == {"one": [1, 2, 3]}
    assert trace_cache.remembered("k", compute) == {"one": [1, 2, 3]} and len(calls) == 1
    (entry,) = [p for p in cache.iterdir() if p.suffix == ".json"]
    entry.write_text('{"value": ')  # cut short, as by a full disk
    assert trace_cache.remembered("k", compute) == {"one": [1, 2, 3]} and len(calls) == 2
    assert trace_cache.remembered("k", compute) and len(calls) == 2  # rewritten whole
    monkeypatch.setattr(trace_cache, "_FINGERPRINT", "an edited titanlab")
    assert trace_cache.remembered("k", compute) and len(calls) == 3
    assert trace_cache.remembered("other key", compute) and len(calls) == 4


def test_off_or_an_unwritable_folder_computes_every_time(tmp_path, monkeypatch):
    calls = []
    compute = lambda: calls.append(1) or len(calls)
    monkeypatch.setenv(trace_cache.ENV, "off")
    assert [trace_cache.remembered("k", compute) for _ in range(2)] == [1, 2]
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(trace_cache.ENV, str(blocker / "traces"))  # under a file: not creatable
    assert [trace_cache.remembered("k", compute) for _ in range(2)] == [3, 4]
    assert not list(tmp_path.rglob("*.json"))


def test_the_source_fingerprint_names_every_module():
    fp = trace_cache.source_fingerprint()
    assert len(fp) == 64 and fp == trace_cache.source_fingerprint()


def test_a_second_process_reads_the_traces_instead_of_tracing(cache, monkeypatch):
    """What a rank does after the launcher's pre-flight traced the same shapes: the numbers
    come from the disk (tracing would fail here), and equal the traced ones."""
    args = dataclasses.replace(
        llama3_flavors["debugmodel"], n_layers=2, vocab_size=611, max_seq_len=64
    )
    traced = trace_activation_bytes(args, 2, 64, torch.float32, modes=("full",))
    assert len(list(cache.glob("*.json"))) == 2  # "none" and "full"
    monkeypatch.setattr(activation_memory, "_CACHE", {})  # as in a new process

    def no_tracing(*a, **k):
        raise AssertionError("traced again")

    monkeypatch.setattr(activation_memory, "FakeTensorMode", no_tracing)
    again = trace_activation_bytes(args, 2, 64, torch.float32, modes=("full",))
    assert again == traced
    assert dataclasses.asdict(again)["per_block"]["full"] > 0
