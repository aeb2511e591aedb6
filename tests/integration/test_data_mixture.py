"""Weighted mixtures and their schedule in the trainer: the shares consumed follow the weights,
a run stopped at step 47 under FSDP 2 and resumed under FSDP 4 trains on the same batches as the
uninterrupted run (token ids compared), and a curriculum shows in the logged per-source counts
and resumes exactly (the recorded batches equal the sampler's stream computed here).
"""

import json
import os
import sys
from collections import defaultdict

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from conftest import TINY, launch  # noqa: E402
from titanlab.data.dataset import MemmapTokenDataset  # noqa: E402
from titanlab.data.default_corpus import default_corpus_files  # noqa: E402
from titanlab.data.mixture import MixtureSampler, WeightSchedule  # noqa: E402
from titanlab.data.prepare import prepare_data  # noqa: E402
from titanlab.data.tokenizer import default_tokenizer_path  # noqa: E402

SEQ, GLOBAL = 64, 8
STEPS = 90  # of the weights-and-resume test


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Two prepared folders: the json and http packages' sources (different text)."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for name in ("json", "http"):
        files = [f for f in default_corpus_files() if f"{os.sep}{name}{os.sep}" in f]
        out[name] = str(root / name)
        prepare_data(files, out[name], default_tokenizer_path(), progress=False)
    return out


def mixture_args(sources, weights, schedule=None) -> list[str]:
    tables = ", ".join(
        f'{{path = "{sources[n]}", weight = {w}, name = "{n}"}}' for n, w in zip(sources, weights)
    )
    args = ["--data.sources", f"[{tables}]"]
    if schedule:
        points = ", ".join(f"{{step = {s}, weights = {list(w)}}}" for s, w in schedule)
        args += ["--data.schedule", f"[{points}]"]
    return args


def run(nproc: int, dump: str, steps: int, *extra: str):
    # The model only consumes the batches these tests compare: the 2-layer flavor (CI time).
    args = [*TINY, "--model.flavor", "debugmodel_tiny", "--training.seq_len", str(SEQ),
            "--training.global_batch_size", str(GLOBAL),
            "--training.local_batch_size", str(GLOBAL // nproc),
            "--training.steps", str(steps), "--metrics.log_freq", "10",
            "--debug.record_batches", "true", "--job.dump_folder", dump,
            "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
            "--parallelism.data_parallel_shard_degree", str(nproc), *extra]  # fmt: skip
    return launch(nproc, args).check()


def global_batches(dump: str) -> dict[int, list[list[int]]]:
    """step → the global batch's samples (sorted), from every dp rank's record."""
    per: dict[tuple[int, int], list[list[int]]] = {}
    folder = os.path.join(dump, "batches")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                rec = json.loads(line)
                per[(rec["step"], rec["dp_rank"])] = rec["inputs"]  # a re-run step: the last
    out: dict[int, list[list[int]]] = defaultdict(list)
    for (step, _), rows in per.items():
        out[step] += rows
    return {step: sorted(rows) for step, rows in out.items()}


def logged_tokens(dump: str) -> dict[int, dict[str, int]]:
    out = {}
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for rec in map(json.loads, f):
            tokens = {k.split("/")[-1]: v for k, v in rec.items() if k.startswith("data/tokens/")}
            if tokens:
                out[rec["step"]] = tokens
    return out


def test_weights_hold_and_a_resume_on_another_dp_size_sees_the_same_batches(sources, tmp_path):
    """90 steps of 8 samples: the json source (216 samples of 64 tokens) supplies 0.7 of them,
    so the run stops at step 47 inside json's second epoch and the resumed one crosses into its
    third (at step ~78). The shares follow the weights within one sample (smooth weighted
    round-robin), well inside 0.01 at 720 samples."""
    weights = (0.7, 0.3)
    mix = mixture_args(sources, weights)
    whole = str(tmp_path / "whole")
    run(2, whole, STEPS, *mix)
    tokens = logged_tokens(whole)[STEPS]
    total = sum(tokens.values())
    assert total == STEPS * GLOBAL * SEQ
    for name, w in zip(sources, weights):
        assert abs(tokens[name] / total - w) < 0.01, tokens
    parted = str(tmp_path / "parted")
    run(2, parted, 47, *mix, "--checkpoint.interval", "47")
    resumed = run(4, parted, STEPS, *mix)
    assert "resumed from" in resumed.stdout or "loaded" in resumed.stdout
    want, got = global_batches(whole), global_batches(parted)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == want[s] for s in want)  # token ids, step by step
    assert logged_tokens(parted)[STEPS] == tokens


def test_schedule_shows_in_the_counts_and_resumes_exactly(sources, tmp_path):
    """Also with document masking and a sequence-length warmup on (they change what the model
    sees of a batch, never which batch)."""
    schedule = [(0, (0.9, 0.1)), (40, (0.1, 0.9))]
    mix = [*mixture_args(sources, (1, 1), schedule), "--data.document_mask", "true",
           "--training.seq_len_warmup_steps", "40", "--training.seq_len_warmup_start", "16"]  # fmt: skip
    dump = str(tmp_path / "sched")
    run(2, dump, 30, *mix, "--checkpoint.interval", "30")
    run(2, dump, 60, *mix)
    counts = logged_tokens(dump)
    first = counts[10]  # steps 1-10: weights 0.9 → 0.7 for json, ~0.79 of the samples
    assert 0.75 < first["json"] / (first["json"] + first["http"]) < 0.85
    last = {k: counts[60][k] - counts[50][k] for k in counts[60]}
    assert last["http"] / (last["json"] + last["http"]) > 0.85
    # The recorded batches are exactly the stream the sampler gives for this config.
    names = list(sources)
    sets = [MemmapTokenDataset(sources[n], SEQ, split="train") for n in names]
    sampler = MixtureSampler([len(s) for s in sets], dp_rank=0, dp_world_size=1, seed=0,
                             samples_per_step=GLOBAL, names=names,
                             schedule=WeightSchedule([1, 1], [(s, w) for s, w in schedule]))  # fmt: skip
    it = iter(sampler)
    recorded = global_batches(dump)
    take = [next(it) for _ in range(60 * GLOBAL)]
    it = iter(take)
    for step in (10, 30, 60):  # the logged counts are the stream's, exactly
        from_json = sum(i < len(sets[0]) for i in take[: step * GLOBAL])
        assert counts[step] == {"json": from_json * SEQ, "http": (step * GLOBAL - from_json) * SEQ}
    for step in range(1, 61):
        want = []
        for _ in range(GLOBAL):
            flat = next(it)
            source = 0 if flat < len(sets[0]) else 1
            want.append(sets[source][flat - (0 if source == 0 else len(sets[0]))][0].tolist())
        assert recorded[step] == sorted(want), step
