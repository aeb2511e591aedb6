"""Measuring the communication of one training step per rank: the trainer's options for a
layout of `tools/lib/comm_predict.py`, a launch with the counter on
(`titanlab/distributed/comm_counter.py`, `TITANLAB_COMM_COUNT`), and its results read back.
`tools/comm_bytes.py` compares them with the closed forms; `tools/lib/zero_bench.py` adds the
memory timeline of the same runs."""

from __future__ import annotations

import glob
import json
import os
import subprocess

from tools.lib.comm_predict import FLAVOR, LOCAL_BS, SEQ, STEPS, Layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_dataset(out: str) -> str:
    """A ~50k-token prepared dataset (10 stdlib email modules, bundled tokenizer) at `out`."""
    from titanlab.data.default_corpus import default_corpus_files
    from titanlab.data.prepare import prepare_data
    from titanlab.data.tokenizer import default_tokenizer_path

    if not os.path.exists(os.path.join(out, "metadata.json")):
        files = [f for f in default_corpus_files() if os.sep + "email" + os.sep in f][:10]
        prepare_data(
            files, out, default_tokenizer_path(), workers=1, shard_size_mb=0.25, progress=False
        )
    return out


def train_args(lay: Layout, dataset: str, dump: str, steps: int) -> list[str]:
    """The trainer's options for `steps` steps of `lay`: `debugmodel_deep`, seq 64, local
    batch 2 per microbatch, no checkpoint or validation, the plain cross-entropy."""
    return [
        "--job.config_file",
        os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--model.flavor",
        FLAVOR,
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        str(LOCAL_BS),
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--data.dataset_path",
        dataset,
        "--job.dump_folder",
        dump,
        "--comm.init_timeout_seconds",
        "120",
        "--comm.train_timeout_seconds",
        "120",
        "--loss.fused_linear_cross_entropy",
        "false",
        *lay.overrides(),
    ]


def measure(
    lay: Layout,
    dataset: str,
    workdir: str,
    timeout: int = 600,
    extra: tuple[str, ...] = (),
    warm: bool = True,
) -> list[dict]:
    """Run 2 steps of `lay` (plus `extra` options) with the counter on; return each rank's
    step-2 `kinds` dict. The run's dump folder is `dump_folder(lay, workdir)`. `warm`: on the
    warm ranks of `tools.lib.rank_pool` (the counter reads its variable when the step runs, and
    what a step sends does not depend on the process it runs in); else a fresh torchrun, for a
    memory timeline of a process of its own.

    Raises RuntimeError with the run's output tail when the run fails."""
    from tools.lib.runs import launch_command

    prefix = _prefix(lay, workdir)
    for old in glob.glob(prefix + ".rank*.json"):
        os.remove(old)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TITANLAB_COMM_COUNT=prefix)
    args = train_args(lay, dataset, dump_folder(lay, workdir), STEPS) + list(extra)
    if warm:
        from tools.lib.rank_pool import warm_run

        proc = warm_run(lay.nproc, args, env=env, timeout=timeout)
    else:
        cmd = launch_command(lay.nproc, ["-m", "titanlab.train", *args])
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{lay.name}: trainer exited {proc.returncode}:\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-2000:]}"
        )
    ranks = []
    for r in range(lay.nproc):
        with open(f"{prefix}.rank{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f)["kinds"])
    return ranks


def _prefix(lay: Layout, workdir: str) -> str:
    return os.path.join(workdir, lay.name.replace(" ", "_").replace("×", "x").replace(",", ""))


def dump_folder(lay: Layout, workdir: str) -> str:
    """The `job.dump_folder` of `lay`'s run under `workdir`."""
    return _prefix(lay, workdir) + "_dump"


def losses(lay: Layout, workdir: str) -> dict[int, float]:
    """The losses by step of `lay`'s run under `workdir` (after `measure`)."""
    from tools.lib.runs import read_losses

    return read_losses(dump_folder(lay, workdir))
