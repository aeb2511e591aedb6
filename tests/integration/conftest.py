"""Fixtures for end-to-end tests: a tiny prepared dataset and a launcher of the real entry point.

Every run is `titanlab.train`'s main on gloo with one intra-op thread per rank and short
timeouts. `launch` runs the ranks on warm workers kept across tests (`tools.lib.rank_pool`:
torchrun's rank environment without its agent; forked from a server that has imported titanlab
once, they skip the first compile's and first trace's one-time costs after their first job;
TITANLAB_WARM_RANKS=0 forks fresh ranks per launch instead); the tests of launching itself (run_train.sh, one-line errors under
torchrun, restarts, Slurm, the RL runs) start `python -m torch.distributed.run` as a user does
(`launch_command`, or `launch(..., entry=...)`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from titanlab.data.default_corpus import default_corpus_files
from titanlab.data.prepare import prepare_data
from titanlab.data.tokenizer import default_tokenizer_path
from titanlab.metrics import parse_log_line
from tools.lib.rank_pool import warm_run
from tools.lib.runs import (  # noqa: F401 (re-exported)
    CONSTANT_LR,
    REPO,
    TINY_RUN,
    checkpoint_every,
    launch_command,
)

# The modules that take longest (seconds of test time in a 2-worker CI run on 2 cores), started
# first, longest first: `make test` hands each pytest-xdist worker a module at a time in this
# order (--dist loadscope --no-loadscope-reorder; xdist would otherwise order modules by their
# number of tests), so the last modules to start are short ones and the two workers end close
# together.
LONGEST_FIRST = (
    "test_feature_pairs.py",  # ~585 s
    "test_parallel_parity.py",  # ~350 s
    "test_qwen3_5.py",  # ~195 s
    "test_fault_tolerance.py",  # ~175 s
    "test_rl.py",  # ~165 s
    "test_qwen3_moe.py",  # ~150 s
    "test_deepseek_v3.py",  # ~145 s
    "test_muon_training.py",  # ~140 s
    "test_compile.py",  # ~125 s
    "test_faults.py",  # ~120 s
    "test_cp_documents.py",  # ~95 s
    "test_fault_tolerance_layouts.py",  # ~70 s
    "test_error_lines.py",  # ~65 s
    "test_generation_exports.py",  # ~65 s
    "test_observability.py",  # ~60 s
)


def pytest_collection_modifyitems(config, items) -> None:
    """Run the modules of `LONGEST_FIRST` first, in that order; the rest keep theirs."""

    def rank(item) -> int:
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a module, and among the rest, the order is kept


SHALLOW = ["--model.n_layers", "2"]
"""The flavor's first 2 blocks (`model.n_layers`), for tests whose check does not depend on the
depth (a resume, a kill, an export, a trace, what compile does to a block): they paid for the
other blocks only in CI time (measured, each timed beside another suite: test_compile 222 -> 166
s, the generation/export module 171 -> 140 s, the MTP resume 72 -> 56 s, a profiler trace 23.0
-> 15.7 s)."""

# A tiny run of the debug model's first 2 blocks (`SHALLOW`; of 6, dim 256), 64-token windows,
# 2 samples per rank: what the tests of a resume, a kill, a layout, an export or a metric check
# does not depend on the depth (the tests that need more blocks set `--model.n_layers`).
TINY = [*TINY_RUN, "--training.local_batch_size", "2", *SHALLOW]
THIN = ["--model.flavor", "debugmodel_deep"]
"""The thin debug flavor (dim 64, 8 layers), for tests that compute in bf16 or fp16 because low
precision is what they test: on CPUs without native bf16 (AVX2) a low-precision matmul runs ~40x
slower than fp32 (docs/contributing.md, "CI"), and what they check does not depend on the width."""
PARITY_FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
"""`make test-parity-full` (and `make test-full`): every case CI trims."""


def full_only(reason: str = "make test-parity-full runs it"):
    """Skipped in CI, run by `make test-full` and `make test-parity-full` (`PARITY_FULL`);
    `reason` says where CI meets what the case checks (tests/coverage_spec.py's cells)."""
    return pytest.mark.skipif(not PARITY_FULL, reason=reason)


CI_COMPILE_BACKEND = [] if PARITY_FULL else ["--compile.backend", "aot_eager"]
"""Options of a run where compile meets another feature: in CI aot_eager (Dynamo's capture and
AOTAutograd's joint graph, where features meet compile) without Inductor's C++ build of each new
graph's kernels; Inductor under TITANLAB_PARITY_FULL=1. Inductor's numerics are
tests/integration/test_compile.py's."""


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    losses: dict[int, float] = field(default_factory=dict)

    def check(self) -> RunResult:
        assert self.returncode == 0, (
            f"run failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"
        )
        return self


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> str:
    """~0.5M tokens of the stdlib corpus, prepared with the bundled tokenizer."""
    out = str(tmp_path_factory.mktemp("data") / "stdlib_small")
    files = [f for f in default_corpus_files() if os.sep + "email" + os.sep in f][:40]
    prepare_data(
        files, out, default_tokenizer_path(), workers=1, shard_size_mb=0.25, progress=False
    )
    return out


def launch(
    nproc: int,
    args: list[str],
    *,
    timeout: int = 600,
    entry: list[str] | None = None,
    log_rank: int | None = None,
) -> RunResult:
    """Run `titanlab.train` with `nproc` ranks (warm workers, `tools.lib.rank_pool`; or the command
    `entry`, e.g. torchrun's `launch_command`); parse the `step: N  loss: X` lines. `log_rank`:
    keep only that rank's stdout, as run_train.sh shows rank 0's (warm workers only)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if entry is None:
        proc = warm_run(nproc, args, env=env, timeout=timeout, log_rank=log_rank)
    else:
        proc = subprocess.run(
            entry + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    result = RunResult(proc.returncode, proc.stdout, proc.stderr)
    for line in proc.stdout.splitlines():
        parsed = parse_log_line(line)
        if parsed:
            result.losses[parsed[0]] = parsed[1]
    return result


@pytest.fixture
def train(tiny_dataset, tmp_path):
    """`train(nproc, *overrides, dump=...)` → RunResult of a tiny run on the tiny dataset."""

    counter = iter(range(1000))

    def run(nproc: int, *overrides: str, dump: str | None = None) -> RunResult:
        dump = dump or str(
            tmp_path / f"run{next(counter)}"
        )  # a fresh folder unless shared on purpose
        args = TINY + ["--data.dataset_path", tiny_dataset, "--job.dump_folder", dump, *overrides]
        return launch(nproc, args)

    return run


def run_config(config: str, *overrides: str, nproc: int = 2, timeout: int = 600) -> RunResult:
    """A shipped config (`train_configs/<name>.toml`, relative to the checkout) with `overrides`
    on `nproc` warm ranks, showing rank 0's output: what `NGPU=nproc ./run_train.sh config
    overrides` trains and prints, without its launch (the launcher's own tests,
    test_run_train*.py, test_faults.py and test_cli_train.py, start it for real)."""
    args = ["--job.config_file", os.path.join(REPO, config), *overrides]
    return launch(nproc, args, timeout=timeout, log_rank=0)


def read_metrics(dump: str) -> dict[int, float]:
    """Exact losses by step from `<dump>/metrics.jsonl` (the last entry wins for a step)."""
    import json

    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return {rec["step"]: rec["loss"] for rec in map(json.loads, f)}


def wait_for(predicate, timeout: float = 300) -> None:
    """Poll `predicate` every 0.2 s until it is true; AssertionError after `timeout` seconds."""
    end = time.time() + timeout
    while not predicate():
        assert time.time() < end, "timed out waiting"
        time.sleep(0.2)


def random_hf_llama_dcp(root, args, max_position_embeddings: int) -> str:
    """A random (seed 0) transformers LlamaForCausalLM of shape `args` saved under `root/hf`
    and imported with `hf_to_dcp` into `root/dcp`; returns the DCP folder. Skips the test when
    transformers is missing."""
    import torch

    transformers = pytest.importorskip("transformers")
    from titanlab.checkpoint.convert import hf_to_dcp
    from titanlab.models.llama3.hf import to_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **to_config(args, torch.float32, max_position_embeddings, 4096, 4097)
    )
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(root, "hf"))
    hf_to_dcp(os.path.join(root, "hf"), os.path.join(root, "dcp"), progress=False)
    return os.path.join(root, "dcp")


def worker_pid(rank: int, dump: str) -> int:
    """PID of the trainer process with RANK=rank whose command line names `dump`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            "titanlab.train" in cmd
            and dump in cmd
            and f"RANK={rank}" in env
            and "torch.distributed.run" not in cmd
        ):
            return int(pid)
    raise AssertionError(f"no rank {rank} process for {dump}")


def assert_killed_rank_resumes_bit_for_bit(dataset: str, root: str, options: list[str]) -> None:
    """kill -9 of rank 1 once the step-4 checkpoint is complete: torchrun restarts the group,
    which must train steps 5-8 bit for bit as a straight run (on warm ranks). Both runs: the
    debug flavor's first 2 blocks (`SHALLOW`) with `options` (the killed one through
    `run_train.sh`), 2 ranks, seq_len 64, local batch 2, deterministic, a constant learning
    rate, a checkpoint every 4 steps, 8 steps, on `dataset`."""
    import signal
    import subprocess

    from titanlab.checkpoint import store

    def common(dump: str) -> list[str]:
        return [*SHALLOW, "--training.seq_len", "64", "--training.local_batch_size", "2",
                "--metrics.log_freq", "1", "--validation.enable", "false",
                "--debug.deterministic", "true", "--checkpoint.keep_latest_k", "0",
                "--checkpoint.export_at_end", "false", "--checkpoint.interval", "4",
                "--data.dataset_path", dataset, "--job.dump_folder", dump,
                *CONSTANT_LR, "--training.steps", "8", *options]  # fmt: skip

    def start(dump: str, env: dict | None) -> subprocess.Popen:
        cmd = [os.path.join(REPO, "run_train.sh"), "train_configs/debug_model.toml",
               *common(dump)]  # fmt: skip
        env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    straight = os.path.join(root, "straight")  # the reference: warm ranks, no launcher needed
    run_config("train_configs/debug_model.toml", *common(straight)).check()
    killed = os.path.join(root, "killed")
    run = start(killed, {"MAX_RESTARTS": "1", "LOG_RANK": "0,1"})
    step4 = os.path.join(killed, "checkpoint", "step-4")
    wait_for(lambda: os.path.isdir(step4) and store.incomplete_reason(step4) is None)
    os.kill(worker_pid(1, killed), signal.SIGKILL)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-4000:]
    want, got = read_metrics(straight), read_metrics(killed)
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]  # bitwise
