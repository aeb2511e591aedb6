"""Running one layout of the parity matrix against one process: the shared run options, the
seed checkpoint and 1-process reference (`prepare_reference`), a layout's run and its worst
|Δloss| (`run_layout`, an `Outcome`). `tools/parity_matrix.py` chooses the layouts (its
docstring gives the method); the family tests (tests/integration/test_qwen3_moe.py, ...) call
these through it.

A layout trains the flavor's first `least_blocks` blocks (`model.n_layers`, loaded from the one
seed checkpoint of the whole flavor), the fewest its pipeline stages and its family's block
kinds need, against the 1-process reference of the same blocks: what a layout changes does not
depend on how many blocks each stage repeats, and on 2 CPU cores every block is paid in every
step (8 ranks of hsdp × cp 2 × tp 2: 10.3 CPU-s for the 8 blocks of `debugmodel_deep`, 5.3 for 2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from titanlab.config.parallelism import Parallelism
from titanlab.distributed.pipeline import stages_per_rank
from titanlab.models.registry import get_family, get_flavor
from titanlab.planning.layouts import Layout
from tools.lib.runs import TINY_RUN, failure_line, launch, read_losses

STEPS = 5  # the 1-process reference's
LAYOUT_STEPS = 3  # each layout's, compared with the reference's first LAYOUT_STEPS
GLOBAL_BATCH = 8
TOLERANCE = 1e-5
BASE_ARGS = [
    *TINY_RUN,
    "--model.flavor",
    "debugmodel_deep",
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    str(GLOBAL_BATCH),
    "--training.local_batch_size",
    str(GLOBAL_BATCH),
    "--checkpoint.export_at_end",
    "false",
    "--checkpoint.interval",
    "1000",
]


FLAVOR = "debugmodel_deep"
LEAST_BLOCKS = {"qwen3_5": 4}
"""Blocks a family's runs keep at least (else 2): Qwen3.5's 4th block is its first full-attention
one (`full_attention_interval` 4); DeepSeek-V3's 2 are its dense block and an MoE one; gpt-oss's
a sliding-window block and a full one."""


def _option(extra: list[str] | tuple[str, ...], name: str, default: str) -> str:
    return extra[extra.index(name) + 1] if name in extra else default


def least_blocks(layout: Layout, extra: list[str] | tuple[str, ...] = ()) -> int | None:
    """The fewest blocks `layout` can train the family of `extra` (`--model.name`, default
    llama3) on: one per pipeline stage (pp × the schedule's stages per rank), and at least the
    family's `LEAST_BLOCKS`; None where that is the whole flavor or `extra` sets the blocks."""
    if "--model.n_layers" in extra:
        return None
    family = _option(extra, "--model.name", "llama3")
    flavor = get_flavor(get_family(family), _option(extra, "--model.flavor", FLAVOR))
    looped = int(_option(extra, "--parallelism.pipeline_parallel_stages_per_rank",
                         str(Parallelism.pipeline_parallel_stages_per_rank)))  # fmt: skip
    stages = layout.pp * (stages_per_rank(layout.schedule, looped) if layout.pp > 1 else 1)
    least = max(LEAST_BLOCKS.get(family, 2), stages)
    return least if least < flavor.n_layers else None


class Reference(dict):
    """The 1-process losses by step (`{step: loss}`), with the run's dump folder (`dir`: its
    metrics and its checkpoint at `LAYOUT_STEPS`) and what made it (`prepare_reference`'s
    arguments), so that `run_layout` can compare a run of fewer blocks with the reference of
    the same blocks (`at`)."""

    def __init__(
        self,
        losses: dict[int, float],
        dir: str,
        root: str,
        dataset: str,
        extra: list[str] | tuple[str, ...],
        microbatches: int,
    ):
        super().__init__(losses)
        self.dir, self.root, self.dataset = dir, root, dataset
        self.extra, self.microbatches = extra, microbatches

    def at(self, blocks: int) -> Reference:
        """The reference on the flavor's first `blocks` blocks (made once)."""
        return prepare_reference(
            self.root, self.dataset, self.extra, self.microbatches, blocks=blocks
        )[2]


@dataclass
class Outcome:
    """One layout's result: worst |Δloss| over the steps, or why it did not run/pass."""

    layout: str
    world_size: int
    max_abs_diff: float | None
    refused: str | None = None
    error: str | None = None
    seconds: float = 0.0
    log: str | None = None  # the whole output of a failed launch
    reference_dir: str | None = None  # the dump folder of the reference compared with
    commit: str | None = None  # the commit the layout ran on (`tools/parity_record.py`)

    def report(self, lines: int = 60) -> str:
        """`error`, followed by the last `lines` lines of the failed launch's output."""
        if self.log is None or not os.path.exists(self.log):
            return str(self.error)
        with open(self.log, encoding="utf-8", errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
        return "\n".join([str(self.error), f"--- last {len(tail)} lines of {self.log}:", *tail])

    @property
    def passed(self) -> bool:
        return (
            self.refused is None
            and self.error is None
            and self.max_abs_diff is not None
            and self.max_abs_diff <= TOLERANCE
        )


def prepare_reference(
    root: str,
    dataset: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
    microbatches: int = 1,
    blocks: int | None = None,
) -> tuple[str, str, Reference]:
    """(dataset, seed checkpoint, 1-process losses) under `root`, made once and reused; `extra`
    options (e.g. `--model.name qwen3`) go to both runs and must go to every layout's too. The
    reference splits the global batch into `microbatches` accumulation steps (for statistics
    taken per global microbatch, like an MoE load-balance loss) and trains the flavor's first
    `blocks` blocks (None: all); each count has its own reference run (`reference`,
    `reference-mb<N>`, `reference-b<K>`) next to the one seed checkpoint."""
    if dataset is None:
        dataset = os.path.join(root, "data")
        if not os.path.exists(os.path.join(dataset, "metadata.json")):
            from titanlab.data.default_corpus import default_corpus_files
            from titanlab.data.prepare import prepare_data
            from titanlab.data.tokenizer import default_tokenizer_path

            files = [f for f in default_corpus_files() if os.sep + "email" + os.sep in f][:40]
            prepare_data(
                files,
                dataset,
                default_tokenizer_path(),
                workers=1,
                shard_size_mb=0.25,
                progress=False,
            )
    base = BASE_ARGS + ["--data.dataset_path", dataset, *extra]
    seed = os.path.join(root, "seed", "checkpoint", "step-0")
    if not os.path.exists(os.path.join(seed, ".metadata")):
        _check(
            launch(
                1,
                base
                + [
                    "--job.dump_folder",
                    os.path.join(root, "seed"),
                    "--checkpoint.create_seed_checkpoint",
                    "true",
                ],
            )
        )
    ref = os.path.join(root, "reference" + (f"-mb{microbatches}" if microbatches > 1 else "")
                       + (f"-b{blocks}" if blocks else ""))  # fmt: skip
    if not os.path.exists(os.path.join(ref, "metrics.jsonl")):
        _check(
            launch(
                1,
                base
                + (["--model.n_layers", str(blocks)] if blocks else [])
                + [
                    "--job.dump_folder",
                    ref,
                    "--training.local_batch_size",
                    str(GLOBAL_BATCH // microbatches),
                    "--checkpoint.initial_load_path",
                    seed,
                    # the state at the layouts' last step, for tests that compare it
                    "--checkpoint.interval",
                    str(LAYOUT_STEPS),
                    "--checkpoint.keep_latest_k",
                    "0",
                ],
            )
        )
    return dataset, seed, Reference(read_losses(ref), ref, root, dataset, extra, microbatches)


def _check(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


# torchrun's summary of a rank killed by SIGSEGV (-11) or SIGABRT (-6).
NATIVE_CRASH = re.compile(r"exitcode\s*:\s*-(?:6|11)\b")


def run_layout(
    layout: Layout,
    dataset: str,
    seed: str,
    reference: dict[int, float],
    root: str,
    extra: list[str] | tuple[str, ...] = (),
    steps: int = LAYOUT_STEPS,
    shallow: bool = True,
) -> Outcome:
    """Train `layout` (plus `extra` options) from `seed` for `steps` (at most the reference's
    `STEPS`) and compare its losses with `reference`'s first `steps`. With `shallow` and a
    `Reference` (`prepare_reference`'s), on the `least_blocks` of the layout, against the
    reference of those blocks; else on every block of the flavor."""
    dump = os.path.join(root, "runs", layout.name)
    start = time.time()
    blocks = least_blocks(layout, extra) if shallow and isinstance(reference, Reference) else None
    if blocks is not None:
        reference = reference.at(blocks)
    args = BASE_ARGS + layout.overrides(GLOBAL_BATCH) + [
        "--data.dataset_path", dataset, "--job.dump_folder", dump,
        "--checkpoint.initial_load_path", seed, "--training.steps", str(steps), *extra,
        *(["--model.n_layers", str(blocks)] if blocks is not None else []),
    ]  # fmt: skip
    proc = launch(layout.world_size, args)
    if proc.returncode != 0 and NATIVE_CRASH.search(proc.stdout + proc.stderr):
        # A rank killed by SIGSEGV/SIGABRT inside gloo (seen twice in CI on 8 oversubscribed
        # CPU ranks with context parallel, each time passing when run again): keep the log
        # and run the layout once more from scratch. A real fault crashes again.
        os.makedirs(os.path.dirname(dump), exist_ok=True)
        with open(f"{dump}-native-crash.log", "w", encoding="utf-8") as f:
            f.write(proc.stdout + "\n" + proc.stderr)
        print(f"{layout.name}: a rank died of a signal in gloo; running it once more "
              f"(log: {dump}-native-crash.log)", flush=True)  # fmt: skip
        shutil.rmtree(dump, ignore_errors=True)
        proc = launch(layout.world_size, args)
    seconds = time.time() - start
    if proc.returncode != 0:
        os.makedirs(dump, exist_ok=True)
        log = os.path.join(dump, "launch.log")
        output = proc.stdout + "\n" + proc.stderr
        with open(log, "w", encoding="utf-8") as f:
            f.write(output)
        return Outcome(
            layout.name,
            layout.world_size,
            None,
            error=f"exit {proc.returncode}: {failure_line(output)}",
            seconds=seconds,
            log=log,
        )
    losses = read_losses(dump)
    if sorted(losses) != list(range(1, steps + 1)):
        return Outcome(
            layout.name,
            layout.world_size,
            None,
            seconds=seconds,
            error=f"logged steps {sorted(losses)}, expected 1..{steps}",
        )
    worst = max(abs(losses[s] - reference[s]) for s in range(1, steps + 1))
    ref_dir = reference.dir if isinstance(reference, Reference) else None
    return Outcome(layout.name, layout.world_size, worst, seconds=seconds, reference_dir=ref_dir)
