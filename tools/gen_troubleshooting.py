"""Generate docs/troubleshooting.md: what a `titanlab: error:` line means, and every such message.

    python tools/gen_troubleshooting.py          # write docs/troubleshooting.md
    python tools/gen_troubleshooting.py --check  # exit 1 when the file is out of date
    python tools/gen_troubleshooting.py --output FILE

The page is never edited by hand. Its prose (the intro and "Most common errors and what to do")
lives in this file as constants. The table of messages is read from the code with `ast`: every
`raise ConfigError(...)` under titanlab/, and every `_require(cond, message)` call in a module
that takes `_require` from titanlab.config.errors. A message becomes a template:
- a plain or implicitly concatenated string is its text;
- an f-string keeps its text and shows each `{expr}` as `<expr>` (conversions and format specs
  dropped);
- `a + b` joins the templates of both sides;
- anything else (a variable, a call) is shown as `<expr>`.
Templates are sorted by module path, then line, so the output only changes when a message, its
function or its module changes. Line numbers are not printed, so moving code does not.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "titanlab"
DEFAULT_OUTPUT = os.path.join("docs", "troubleshooting.md")
ERRORS_MODULE = "titanlab.config.errors"


@dataclass(frozen=True)
class Template:
    """One place that raises a ConfigError, and the message it raises."""

    module: str  # path relative to the repository, with "/" separators
    line: int
    function: str  # qualified name of the enclosing def, e.g. "Training.validate"; "" at top level
    message: str


# --- reading the code ---------------------------------------------------------------------------
def render(node: ast.expr) -> str:
    """The message template of the expression `node` (see the module docstring)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append(f"<{ast.unparse(value.value)}>")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return render(node.left) + render(node.right)
    return f"<{ast.unparse(node)}>"


def _is_config_error(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "ConfigError") or (
        isinstance(func, ast.Attribute) and func.attr == "ConfigError"
    )


def _uses_require(tree: ast.Module, dotted: str) -> bool:
    """Whether `_require` in this module is the one of titanlab.config.errors."""
    if dotted == ERRORS_MODULE:
        return True
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == ERRORS_MODULE
        and any(alias.name == "_require" for alias in node.names)
        for node in ast.walk(tree)
    )


class _Finder(ast.NodeVisitor):
    """Collects the templates of one module, keeping track of the enclosing class/def names."""

    def __init__(self, module: str, with_require: bool) -> None:
        self.module = module
        self.with_require = with_require
        self.scope: list[str] = []
        self.found: list[Template] = []

    def _enter(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def _add(self, node: ast.AST, message: ast.expr | None) -> None:
        text = render(message) if message is not None else "(no message)"
        self.found.append(Template(self.module, node.lineno, ".".join(self.scope), text))

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc
        # `_require` itself re-raises its caller's message; its callers are listed instead.
        if self.scope[-1:] != ["_require"]:
            if isinstance(exc, ast.Call) and _is_config_error(exc.func):
                self._add(node, exc.args[0] if exc.args else None)
            elif exc is not None and _is_config_error(exc):
                self._add(node, None)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if self.with_require and isinstance(node.func, ast.Name) and node.func.id == "_require":
            self._add(node, node.args[1] if len(node.args) > 1 else None)
        self.generic_visit(node)


def module_files(repo: str = REPO) -> list[str]:
    """Every .py file of the package, as sorted repository-relative paths with "/"."""
    out = []
    for root, dirs, names in os.walk(os.path.join(repo, PACKAGE)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [
            os.path.relpath(os.path.join(root, n), repo).replace(os.sep, "/")
            for n in names
            if n.endswith(".py")
        ]
    return sorted(out)


def find_templates(repo: str = REPO) -> list[Template]:
    """Every ConfigError message template of the package, sorted by module path, then line."""
    found: list[Template] = []
    for rel in module_files(repo):
        with open(os.path.join(repo, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        dotted = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        finder = _Finder(rel, _uses_require(tree, dotted))
        finder.visit(tree)
        found += finder.found
    return sorted(found, key=lambda t: (t.module, t.line))


# --- writing the page ---------------------------------------------------------------------------
INTRO = """\
# Troubleshooting

<!-- Generated by tools/gen_troubleshooting.py; do not edit. Run the script after changing an
error message (tests/unit/test_troubleshooting_doc.py fails until you do). -->

## What a `titanlab: error:` line is

When titanlab stops because of something you can fix (an option, a file, the data, the size of
the run), it prints one line that starts with `titanlab: error:` and names the bad value. The
line is always a single line, and it is the last line on stderr. Above it may be the normal log
of the run; there is no Python traceback for these errors.

The line can come from three places:

- **The pre-flight check** (`python -m titanlab.preflight`), which `run_train.sh` and
  `titanlab train` run in torchrun's agent before it starts a rank (`titanlab.launcher
  --preflight`), and `multinode_trainer.slurm` before `srun`. It checks the config, the parallel
  layout, the batch split, the memory estimate, the tokenizer, the dataset folder, the dump folder
  and `checkpoint.load_step`. It needs no process group and writes nothing, so these errors come
  in seconds.
- **A rank**, for what can only be seen once training runs: a loss that became NaN, a collective
  that timed out, a checkpoint that cannot be loaded. Every rank also repeats the pre-flight
  checks before it creates its process group.
- **The launcher** (`python -m titanlab.launcher`, which wraps torchrun). It hides torchrun's own
  report of the failed child. It prints the path of the launcher log, then the error line of the
  lowest rank that failed with a titanlab error, and exits with that rank's exit code.

The exit code tells the kind of failure:

| exit code | meaning | raised as |
|---|---|---|
| 0 | The run finished. | |
| 2 | A configuration or input error: the line names the option or file. | `ConfigError` |
| 3 | The loss became NaN or infinite. | `TrainingDiverged` (titanlab/resilience/failures.py) |
| 4 | A collective timed out: some rank stopped responding. | a process-group timeout |
| 5 | A rank ran out of memory. With `profiling.enable_memory_snapshot` the line names the snapshot written for it (CUDA: the allocator history; CPU: the recorded window's memory timeline up to the failure). | `OutOfMemory` (titanlab/resilience/failures.py) |
| 75 | Preempted (SIGTERM or SIGUSR1) after saving a checkpoint. Run the same command to resume. | `Preempted` |

Exit code 75 is not an error: there is no `titanlab: error:` line, and `run_train.sh` prints
`run_train.sh: preempted after step N; exit 75 to requeue` instead.

Any other failure (a crash with a Python traceback) keeps the rank's traceback on the terminal
and ends with `titanlab: error: training failed (torchrun exit code N); the failing rank's output
is above`.

**The launcher log.** torchrun's traceback and its "failed (exitcode: N)" report go to
`<job.dump_folder>/logs/launcher-<date>-<time>-<host>-<pid>.log` (the system's temporary folder
when that one cannot be created). The launcher prints the path on the line before the error
line: `titanlab: launcher report (torchrun's traceback): PATH`. Only rank 0's output is shown by
default; `LOG_RANK=0,1` shows more ranks.
"""

COMMON = """\
## Most common errors and what to do

**Unknown option.** `unknown config key training.step; did you mean 'training.steps'?` (or
`unknown config section [trainig]`). A name in the TOML file or on the command line does not
exist. Use the suggested name. `python -m titanlab.train --help` lists every option with its type
and default.

**The degrees do not multiply to the number of processes.** `dp_replicate*dp_shard*cp*tp*pp =
1*2*1*2*1 = 4 does not equal the world size 2`, or `world size 6 is not divisible by
dp_replicate*cp*tp*pp = ...`. The world size is `NGPU` (on one machine) or nodes × ranks per
node. Change `NGPU` or the degrees. Leave `parallelism.data_parallel_shard_degree = -1` to let it
take whatever the other degrees leave.

**tp does not divide the heads.** `parallelism.tensor_parallel_degree=3 must divide the number of
heads (8) and of KV heads (4) of debugmodel`. Tensor parallel gives each rank whole attention
heads, so tp must divide both counts. For the debug model that is tp = 1, 2 or 4. `training.seq_len`
must also be divisible by tp (sequence parallel splits it), and by 2·cp under context parallel.

**The batch does not split.** `training.global_batch_size=10 is not divisible by local_batch_size
× dp = 2 × 4 = 8; use a multiple of 8`. The global batch is local batch × data-parallel degree ×
gradient-accumulation steps. Choose a multiple of the number it names, or leave
`training.global_batch_size = -1` (no accumulation). Under pipeline parallel,
`training.local_batch_size` must also be a multiple of
`parallelism.pipeline_parallel_microbatch_size`, and give at least as many microbatches as the
schedule needs.

**The model does not fit.** `model.flavor=8B needs about 68.9 GiB per rank (params ..., grads ...,
optimizer ..., activations ... GiB) on 2 rank(s), but there is ...`. The pre-flight memory estimate
(titanlab/planning/memory.py) is larger than a rank's GPU memory, or than the host's available memory
divided by the processes on it. Use more ranks with FSDP or TP, turn on
`activation_checkpoint.mode`, or lower `training.local_batch_size` or `training.seq_len`.
`python tools/estimate_memory.py --nproc N --job.config_file FILE` prints the estimate by
category. `--training.memory_check false` skips the check, and the run may then fail with an
out-of-memory error.

**The dataset cannot be read.** `data.dataset_path='data/x' is not a directory; make one with
tools/prepare_data.py`, or `data.dataset_path='data/x': 'data/x/metadata.json' not found`, or
`... shard 'data/x/shard_00003.bin' has 1000 bytes, metadata says 4096`, or
`... 'data/x/metadata.json' is not valid JSON`. The folder must be the output of
`tools/prepare_data.py`: a `metadata.json` and the `shard_XXXXX.bin` files it lists, each of the
listed length. Run `tools/prepare_data.py` again with the same inputs and `--output`. It keeps
every shard that is complete and rewrites the others.

**`checkpoint.load_step` names no complete checkpoint.** `checkpoint.load_step=40:
outputs/x/checkpoint/step-40 cannot be loaded: it does not exist; complete steps: [10, 20, 30]`.
Choose one of the listed steps, or `-1` for the newest complete one. A folder cut off while it was
written (no `.metadata`, or a truncated data file) is never loaded.

**The data was tokenized with another tokenizer.** `data.dataset_path='data/x' was tokenized with
tokenizer A but model.tokenizer_path is B; prepare it again`, or `... has token ids up to
vocab_size=128256, more than the tokenizer's 4352`. Set `model.tokenizer_path` to the tokenizer
the data was prepared with, or prepare the data again with
`tools/prepare_data.py --tokenizer PATH`.

**The dump folder cannot be written.** `job.dump_folder='/data/run' cannot be written: /data is
not writable; choose a folder you can write`. Checkpoints, metrics and the launcher log go there.
Choose a folder you can write, on a filesystem every node sees for multi-node runs.

**The loss diverged (exit 3).** `loss is nan at step 412; last complete checkpoint:
outputs/x/checkpoint/step-400 (lower optimizer.lr or check the data)`. The loss stays on the
device between logging steps (no host sync); on every step that logs, validates or checkpoints,
and on the last, the loop (titanlab/trainer/loop.py) fetches the window's losses at once and raises
`TrainingDiverged` (titanlab/resilience/failures.py) naming the first step whose global loss is NaN or
infinite. At most `metrics.log_freq - 1` later steps have run by then, and no checkpoint is
written after a non-finite loss. Lower `optimizer.lr`, lengthen `lr_scheduler.warmup_steps` or lower `training.max_norm`, then
run again. With `checkpoint.enable` it resumes from the last complete checkpoint. If it diverges
at the same step again, look at the data of that step.

**Non-finite steps skipped, then stopped (exit 3).** With `training.skip_nonfinite_steps` set
to N (not -1) every step's global loss and gradient norm are checked before the optimizer update
(titanlab/resilience/nonfinite.py; one host sync per step): a NaN or infinite one is not applied
and logs `step 17 skipped: loss nan, grad norm nan (non-finite step 1 in a row of at most 3:
training.skip_nonfinite_steps); ...`, and the (N+1)-th in a row ends the run with `step 17: loss
or grad norm non-finite for 4 consecutive steps (14-17; training.skip_nonfinite_steps=3): ...,
stopped before its update; last complete checkpoint: ...`. Isolated skips are a bad batch; a
stop means the run diverged (as above). Under float16 a gradient overflow is the loss scaler's
(`skipped: float16 gradients overflowed`) and is not counted.

**A collective timed out (exit 4).** `rank 0: a collective timed out at step 6
(comm.train_timeout_seconds=100); a peer rank stopped responding. Last complete checkpoint: ...`.
Some rank did not join a collective in time. Usually another rank died or hangs: show its output
with `LOG_RANK=0,1,...` and read the launcher log. Once step 1 has finished the limit is
`comm.train_timeout_seconds`; before that (process-group creation, the first step, compilation)
it is `comm.init_timeout_seconds`. When one step, a validation or a checkpoint save really takes
longer than the limit, raise it. A timeout before the trainer was built ends with a traceback
instead of this line.
"""

TABLE_INTRO = """\
## Every error message

Each row is one place in the code that raises a `ConfigError` (exit code 2), read from the
source by tools/gen_troubleshooting.py. `<expr>` stands for a value filled in at run time. The
rows are grouped by module, in the order of the source.
"""


def code_span(text: str) -> str:
    """`text` as a Markdown code span that is safe inside a table cell."""
    text = text.replace("\n", "\\n").replace("|", "\\|")
    ticks = 1
    while "`" * ticks in text:
        ticks += 1
    fence = "`" * ticks
    pad = " " if text.startswith("`") or text.endswith("`") or ticks > 1 else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_table(templates: list[Template]) -> str:
    """The generated part: one table per module, `| message | raised in |`."""
    lines: list[str] = []
    for module in sorted({t.module for t in templates}):
        lines += ["", f"### {module}", "", "| message | raised in |", "|---|---|"]
        for t in (t for t in templates if t.module == module):
            where = f"`{t.function}`" if t.function else "module level"
            lines.append(f"| {code_span(t.message)} | {where} |")
    return "\n".join(lines)


def render_page(templates: list[Template]) -> str:
    """The whole of docs/troubleshooting.md."""
    count = f"\n{len(templates)} messages in {len({t.module for t in templates})} modules.\n"
    return f"{INTRO}\n{COMMON}\n{TABLE_INTRO}{count}{render_table(templates)}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when the file differs from what it would write",
    )
    parser.add_argument(
        "--output",
        default=os.path.join(REPO, DEFAULT_OUTPUT),
        help=f"file to write (default: {DEFAULT_OUTPUT})",
    )
    args = parser.parse_args(argv)
    wanted = render_page(find_templates())
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != wanted:
            print(f"{args.output} is out of date; run python tools/gen_troubleshooting.py")
            return 1
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
